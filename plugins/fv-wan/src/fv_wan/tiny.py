"""The embedded ``wan2.1-t2v-tiny`` checkpoint: Wan2.1's real architecture at
tiny size with RANDOM weights from a fixed seed, written once in the published
diffusers layout so it loads through the same loader as the real checkpoints.

Its outputs are noise-like videos; it exists for tests, demos and benchmarks.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from fv_core.weights import cache_dir, materialize

TINY_ID = "wan2.1-t2v-tiny"
TINY_VERSION = "v1"  # bump when the configs, vocabulary or seed below change
SEED = 20250101

# The scheduler config Wan2.1 T2V ships (UniPC multistep, flow sigmas, flow shift 3).
WAN_SCHEDULER_CONFIG = {
    "_class_name": "UniPCMultistepScheduler",
    "beta_end": 0.02,
    "beta_schedule": "linear",
    "beta_start": 0.0001,
    "disable_corrector": [],
    "dynamic_thresholding_ratio": 0.995,
    "final_sigmas_type": "zero",
    "flow_shift": 3.0,
    "lower_order_final": True,
    "num_train_timesteps": 1000,
    "predict_x0": True,
    "prediction_type": "flow_prediction",
    "rescale_betas_zero_snr": False,
    "sample_max_value": 1.0,
    "solver_order": 2,
    "solver_p": None,
    "solver_type": "bh2",
    "steps_offset": 0,
    "thresholding": False,
    "timestep_spacing": "linspace",
    "trained_betas": None,
    "use_beta_sigmas": False,
    "use_exponential_sigmas": False,
    "use_flow_sigmas": True,
    "use_karras_sigmas": False,
}

TINY_TRANSFORMER = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=16,
    in_channels=16,
    out_channels=16,
    text_dim=32,
    freq_dim=256,
    ffn_dim=64,
    num_layers=2,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    rope_max_seq_len=1024,
)
TINY_VAE = dict(base_dim=3, z_dim=16)
TINY_TEXT = dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, relative_attention_num_buckets=8)

# A small closed vocabulary; words outside it map to <unk>.
_WORDS = (
    "a an the of in on at with and or to from by over under near into through is are "
    "cat dog bird fish horse person man woman child robot car boat train ship plane tree flower "
    "forest mountain river lake ocean sea beach city street road house kitchen room window door "
    "sky cloud sun moon star rain snow fire water light shadow night day morning evening sunset "
    "red orange yellow green blue purple black white gray golden silver bright dark "
    "big small tall old young happy slow fast quiet loud soft warm cold "
    "running walking flying swimming jumping dancing sitting standing eating playing baking "
    "cake bread flour cup table chair book camera video film scene shot view close wide "
    "cinematic realistic detailed blurry static low quality worst overexposed ugly "
    "astronaut space planet galaxy street neon rainy cozy wooden stone glass"
).split()


def tiny_vocab() -> dict[str, int]:
    """Word -> id, with UMT5's special ids: <pad>=0, </s>=1, <unk>=2."""
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2}
    for word in _WORDS:
        vocab.setdefault(word, len(vocab))
    return vocab


def tiny_weights(path: str | os.PathLike | None = None) -> str:
    """Materialize the tiny checkpoint (once) and return its folder.

    :param path: target folder; default ``<cache>/weights/wan2.1-t2v-tiny/v1``.
    """
    target = Path(path) if path is not None else cache_dir() / "weights" / TINY_ID / TINY_VERSION
    return materialize(target, write_tiny_checkpoint)


def write_tiny_checkpoint(folder: Path, transformer: dict | None = None, seed: int = SEED) -> None:
    """Write the full diffusers layout into ``folder`` (random weights from ``seed``).

    :param transformer: overrides of the transformer config (the benchmark's medium size).
    """
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    folder = Path(folder)
    vocab = tiny_vocab()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        dit = WanTransformer3DModel(**{**TINY_TRANSFORMER, **(transformer or {})})
        vae = AutoencoderKLWan(**TINY_VAE)
        text_config = UMT5Config(vocab_size=len(vocab), pad_token_id=0, eos_token_id=1, **TINY_TEXT)
        text_encoder = UMT5EncoderModel(text_config)
    dit.save_pretrained(folder / "transformer", safe_serialization=True)
    vae.save_pretrained(folder / "vae", safe_serialization=True)
    text_encoder.save_pretrained(folder / "text_encoder", safe_serialization=True)
    word_tokenizer(vocab).save_pretrained(folder / "tokenizer")
    write_pipeline_files(folder)


def write_pipeline_files(folder: Path) -> None:
    """``scheduler/`` (Wan's UniPC config) and ``model_index.json`` of a diffusers WanPipeline folder."""
    (folder / "scheduler").mkdir(exist_ok=True)
    (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps(WAN_SCHEDULER_CONFIG, indent=2))
    model_index = {
        "_class_name": "WanPipeline",
        "scheduler": ["diffusers", "UniPCMultistepScheduler"],
        "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
        "transformer": ["diffusers", "WanTransformer3DModel"],
        "vae": ["diffusers", "AutoencoderKLWan"],
    }
    (folder / "model_index.json").write_text(json.dumps(model_index, indent=2))


def word_tokenizer(vocab: dict[str, int]):
    """A word-level tokenizer over ``vocab`` with T5's conventions (lowercase, ``</s>`` appended;
    ``<pad>``=0, ``</s>``=1, ``<unk>``=2), built offline: the tiny checkpoint's and fv-train-flow's."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>", model_max_length=512
    )
