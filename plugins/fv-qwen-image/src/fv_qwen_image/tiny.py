"""The embedded tiny checkpoint: Qwen-Image's real architecture (QwenImageTransformer2DModel, a
Qwen2.5-VL text encoder, AutoencoderKLQwenImage, FlowMatchEuler with dynamic shifting) at tiny size
with RANDOM weights from a fixed seed, written once in the published diffusers layout so it loads
through the same loader as ``Qwen/Qwen-Image``. Its images are noise; it exists for tests, demos and
benchmarks.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from fv_core.weights import cache_dir, materialize

TINY_ID = "qwen-image-tiny"
TINY_VERSION = "v1"  # bump when the configs, vocabulary or seed below change
SEED = 20250804

# The scheduler config Qwen/Qwen-Image ships: FlowMatchEuler, the shift computed from the image's
# token count (mu) between 256 and 8192 tokens, stretched to end at sigma 0.02.
QWEN_SCHEDULER_CONFIG = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "invert_sigmas": False,
    "max_image_seq_len": 8192,
    "max_shift": 0.9,
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "shift_terminal": 0.02,
    "stochastic_sampling": False,
    "time_shift_type": "exponential",
    "use_beta_sigmas": False,
    "use_dynamic_shifting": True,
    "use_exponential_sigmas": False,
    "use_karras_sigmas": False,
}

TEXT_DIM = 32  # the text encoder's hidden size = the transformer's joint_attention_dim
TINY_TRANSFORMER = dict(
    patch_size=2,
    in_channels=64,
    out_channels=16,
    num_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=TEXT_DIM,
    axes_dims_rope=(4, 6, 6),
)
TINY_VAE = dict(
    base_dim=8,
    z_dim=16,
    dim_mult=[1, 2, 2, 2],
    num_res_blocks=1,
    latents_mean=[round(0.05 * (i % 7) - 0.15, 3) for i in range(16)],
    latents_std=[round(0.8 + 0.1 * (i % 5), 3) for i in range(16)],
)
TINY_TEXT = dict(
    hidden_size=TEXT_DIM,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=4096,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
)
TINY_VISION = dict(
    depth=1,
    hidden_size=16,
    intermediate_size=32,
    num_heads=2,
    out_hidden_size=TEXT_DIM,
    fullatt_block_indexes=[0],
)
# Qwen2's special tokens (the template's and the vision markers the edit pipeline uses)
SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
]


def tiny_weights(path: str | os.PathLike | None = None) -> str:
    """Materialize the tiny checkpoint (once) and return its folder.

    :param path: target folder; default ``<cache>/weights/qwen-image-tiny/v1``.
    """
    target = Path(path) if path is not None else cache_dir() / "weights" / TINY_ID / TINY_VERSION
    return materialize(target, write_tiny_checkpoint)


def write_tiny_checkpoint(
    folder: Path,
    transformer: dict | None = None,
    seed: int = SEED,
    text: dict | None = None,
    vae_config: dict | None = None,
) -> None:
    """Write the full Qwen-Image diffusers layout into ``folder`` (random weights from ``seed``).

    :param transformer: overrides of the transformer config (a second shape, the benchmark's size).
    :param text: overrides of the text encoder's text config (its hidden size follows ``joint_attention_dim``).
    :param vae_config: overrides of the VAE config.
    """
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    folder = Path(folder)
    tokenizer = byte_tokenizer()
    dit_config = {**TINY_TRANSFORMER, **(transformer or {})}
    text_config = {
        **TINY_TEXT,
        "hidden_size": dit_config["joint_attention_dim"],
        **(text or {}),
        "vocab_size": len(tokenizer),
    }
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL}
    special = dict(
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"]
    )
    text_config.update(special)
    config = Qwen2_5_VLConfig(
        text_config=text_config,
        vision_config={**TINY_VISION, "out_hidden_size": text_config["hidden_size"]},
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|image_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        **special,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        dit = QwenImageTransformer2DModel(**dit_config)
        vae = AutoencoderKLQwenImage(**{**TINY_VAE, **(vae_config or {})})
        text_encoder = Qwen2_5_VLForConditionalGeneration(config)
    dit.save_pretrained(folder / "transformer", safe_serialization=True)
    vae.save_pretrained(folder / "vae", safe_serialization=True)
    text_encoder.save_pretrained(folder / "text_encoder", safe_serialization=True)
    tokenizer.save_pretrained(folder / "tokenizer")
    write_pipeline_files(folder)


def write_pipeline_files(folder: Path) -> None:
    """``scheduler/`` (Qwen-Image's config) and ``model_index.json`` of a QwenImagePipeline folder."""
    (folder / "scheduler").mkdir(exist_ok=True)
    (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps(QWEN_SCHEDULER_CONFIG, indent=2))
    model_index = {
        "_class_name": "QwenImagePipeline",
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
        "tokenizer": ["transformers", "Qwen2Tokenizer"],
        "transformer": ["diffusers", "QwenImageTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKLQwenImage"],
    }
    (folder / "model_index.json").write_text(json.dumps(model_index, indent=2))


def byte_tokenizer():
    """A Qwen2Tokenizer (byte-level BPE, Qwen2's pre-tokenizer) whose vocabulary is the 256 bytes and no
    merges, plus Qwen2's special tokens: every byte of a prompt is a token. Built offline."""
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {ch: i for i, ch in enumerate(bytes_to_unicode().values())}
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], model_max_length=32768)
    tok.add_special_tokens({"additional_special_tokens": SPECIAL[1:]})
    return tok


# The edit checkpoints: the same tiny model plus processor/ (Qwen2.5-VL's image processor and the
# tokenizer), a VAE of a quarter the width (the edit pipelines encode the input at ~1024x1024 whatever the
# output size, so the encode dominates a tiny edit) and a vision tower whose image tokens stay few.
EDIT_IDS = {
    "QwenImageEditPipeline": "qwen-image-edit-tiny",
    "QwenImageEditPlusPipeline": "qwen-image-edit-plus-tiny",
}
EDIT_VAE = dict(base_dim=2)
# Qwen-Image-Edit's processor settings but a small pixel budget: at most 16 merged image tokens
TINY_PROCESSOR = dict(size={"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 16})


def tiny_edit_weights(path: str | os.PathLike | None = None) -> str:
    """The tiny Qwen-Image-Edit checkpoint (written once); ``path`` as :func:`tiny_weights`'s."""
    return _edit_weights("QwenImageEditPipeline", path)


def tiny_edit_plus_weights(path: str | os.PathLike | None = None) -> str:
    """The tiny Qwen-Image-Edit Plus checkpoint (several input images; written once)."""
    return _edit_weights("QwenImageEditPlusPipeline", path)


def _edit_weights(pipeline: str, path: str | os.PathLike | None) -> str:
    target = Path(path) if path is not None else cache_dir() / "weights" / EDIT_IDS[pipeline] / TINY_VERSION
    return materialize(target, lambda folder: write_edit_checkpoint(folder, pipeline))


def write_edit_checkpoint(
    folder: Path,
    pipeline: str = "QwenImageEditPipeline",
    transformer: dict | None = None,
    seed: int = SEED,
    text: dict | None = None,
) -> None:
    """Write a Qwen-Image-Edit (or Edit Plus: ``pipeline``) diffusers layout into ``folder``: the model
    as :func:`write_tiny_checkpoint` writes it, ``processor/`` and the pipeline's ``model_index.json``."""
    folder = Path(folder)
    write_tiny_checkpoint(folder, transformer, seed, text, EDIT_VAE)
    _image_processor().save_pretrained(folder / "processor")
    byte_tokenizer().save_pretrained(folder / "processor")
    index = json.loads((folder / "model_index.json").read_text())
    index.update(_class_name=pipeline, processor=["transformers", "Qwen2VLProcessor"])
    (folder / "model_index.json").write_text(json.dumps(index, indent=2))


def _image_processor():
    """Qwen2.5-VL's image processor (patch 14, merge 2, CLIP's mean and std) with TINY_PROCESSOR's pixels."""
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(**TINY_PROCESSOR)
