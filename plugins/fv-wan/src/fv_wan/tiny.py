"""The embedded tiny checkpoints: Wan's real architectures at tiny size with
RANDOM weights from a fixed seed, written once in the published diffusers
layouts so they load through the same loader as the real checkpoints.

``wan2.1-t2v-tiny`` and one per variant (Wan2.1 I2V, Wan2.2 TI2V-5B, Wan2.2
A14B T2V and I2V: ``VARIANTS``). Their outputs are noise-like videos; they exist
for tests, demos and benchmarks.
"""

from __future__ import annotations

import json
import os
from functools import partial
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
# Wan2.2 TI2V-5B's VAE layout at tiny width: 48 latent channels, 2x2 pixel patches, x16 space
TINY_VAE_22 = dict(
    base_dim=4,
    decoder_base_dim=4,
    z_dim=48,
    is_residual=True,
    in_channels=12,
    out_channels=12,
    patch_size=2,
    scale_factor_spatial=16,
    latents_mean=[round(0.05 * (i % 7) - 0.15, 3) for i in range(48)],
    latents_std=[round(0.8 + 0.1 * (i % 5), 3) for i in range(48)],
)
TINY_CLIP = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=32,
    patch_size=8,
)
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


# variant -> what its folder holds beyond Wan2.1 T2V's: transformer config, VAE, pipeline class and
# config, optional components (as the published Wan2.1 I2V / Wan2.2 folders lay them out)
VARIANTS: dict[str, dict] = {
    "t2v": dict(),
    "i2v": dict(
        transformer=dict(in_channels=36, image_dim=32, added_kv_proj_dim=32),
        pipeline="WanImageToVideoPipeline",
        image_encoder=True,
    ),
    "ti2v": dict(transformer=dict(in_channels=48, out_channels=48), vae=TINY_VAE_22, expand_timesteps=True),
    "t2v-a14b": dict(boundary_ratio=0.875, experts=2),
    "i2v-a14b": dict(
        transformer=dict(in_channels=36), pipeline="WanImageToVideoPipeline", boundary_ratio=0.9, experts=2
    ),
}


def variant_weights(variant: str) -> str:
    """Materialize the tiny checkpoint of ``variant`` (once) and return its folder."""
    target = cache_dir() / "weights" / f"wan-tiny-{variant}" / TINY_VERSION
    return materialize(target, lambda folder: write_tiny_checkpoint(folder, variant=variant))


# the tiny cards' ``default_weights`` (a card names a callable without arguments)
i2v_weights = partial(variant_weights, "i2v")
ti2v_weights = partial(variant_weights, "ti2v")
t2v_a14b_weights = partial(variant_weights, "t2v-a14b")
i2v_a14b_weights = partial(variant_weights, "i2v-a14b")


def write_tiny_checkpoint(
    folder: Path, transformer: dict | None = None, seed: int = SEED, variant: str = "t2v"
) -> None:
    """Write the full diffusers layout of ``variant`` into ``folder`` (random weights from ``seed``).

    :param transformer: overrides of the transformer config (the benchmark's medium size, a second shape).
    """
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        CLIPVisionModel,
        UMT5Config,
        UMT5EncoderModel,
    )

    folder, spec = Path(folder), VARIANTS[variant]
    vocab = tiny_vocab()
    dit_config = {**TINY_TRANSFORMER, **spec.get("transformer", {}), **(transformer or {})}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        experts = [WanTransformer3DModel(**dit_config) for _ in range(spec.get("experts", 1))]
        vae = AutoencoderKLWan(**spec.get("vae", TINY_VAE))
        text_config = UMT5Config(vocab_size=len(vocab), pad_token_id=0, eos_token_id=1, **TINY_TEXT)
        text_encoder = UMT5EncoderModel(text_config)
        clip = CLIPVisionModel(CLIPVisionConfig(**TINY_CLIP)) if spec.get("image_encoder") else None
    for name, dit in zip(("transformer", "transformer_2"), experts, strict=False):
        dit.save_pretrained(folder / name, safe_serialization=True)
    vae.save_pretrained(folder / "vae", safe_serialization=True)
    text_encoder.save_pretrained(folder / "text_encoder", safe_serialization=True)
    word_tokenizer(vocab).save_pretrained(folder / "tokenizer")
    if clip is not None:
        clip.save_pretrained(folder / "image_encoder", safe_serialization=True)
        side = TINY_CLIP["image_size"]
        processor = CLIPImageProcessor(
            size={"shortest_edge": side}, crop_size={"height": side, "width": side}
        )
        processor.save_pretrained(folder / "image_processor")
    write_pipeline_files(folder, variant)


def write_pipeline_files(folder: Path, variant: str = "t2v") -> None:
    """``scheduler/`` (Wan's UniPC config) and ``model_index.json`` of a diffusers Wan pipeline folder."""
    spec = VARIANTS[variant]
    (folder / "scheduler").mkdir(exist_ok=True)
    (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps(WAN_SCHEDULER_CONFIG, indent=2))
    dit = ["diffusers", "WanTransformer3DModel"]
    clip = spec.get("image_encoder")
    model_index = {
        "_class_name": spec.get("pipeline", "WanPipeline"),
        "scheduler": ["diffusers", "UniPCMultistepScheduler"],
        "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
        "transformer": dit,
        "vae": ["diffusers", "AutoencoderKLWan"],
    }
    if variant != "t2v":  # Wan2.2-era folders list every slot and the pipeline's config
        model_index.update(
            transformer_2=dit if spec.get("experts") == 2 else [None, None],
            boundary_ratio=spec.get("boundary_ratio"),
            expand_timesteps=spec.get("expand_timesteps", False),
        )
    if model_index["_class_name"] == "WanImageToVideoPipeline":
        model_index.update(
            image_encoder=["transformers", "CLIPVisionModel"] if clip else [None, None],
            image_processor=["transformers", "CLIPImageProcessor"] if clip else [None, None],
        )
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
