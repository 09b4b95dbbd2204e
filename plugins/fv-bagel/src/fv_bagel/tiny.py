"""``bagel-tiny``: BAGEL's architecture at tiny size with RANDOM weights from a fixed seed, written once
in the published layout (``ema.safetensors``, ``ae.safetensors`` in BFL's names, ``llm_config.json``,
``vit_config.json`` and a Qwen2-style byte-level BPE tokenizer with Qwen2.5's special tokens, trained
offline on a few sentences) so it loads through the same loader as BAGEL-7B-MoT. Its text and images
are noise; it exists for tests, demos and benchmarks.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from fv_core.weights import cache_dir, materialize

TINY_ID = "bagel-tiny"
TINY_VERSION = "v2"  # bump when the configs, tokenizer or seed below change (v2: unscaled position tables)
SEED = 20250520

# Qwen2.5's special tokens in its own order (BAGEL uses <|im_start|>, <|im_end|>, <|vision_start|>,
# <|vision_end|>); they come after the BPE vocabulary, as in Qwen2.5's tokenizer.
SPECIAL = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
]  # fmt: skip
BPE_VOCAB = 320  # byte alphabet (256) + merges

TINY_LLM: dict[str, Any] = dict(
    model_type="qwen2",
    architectures=["Qwen2ForCausalLM"],
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    hidden_act="silu",
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=False,
    use_sliding_window=False,
    bos_token_id=None,
    eos_token_id=None,
)
TINY_VIT: dict[str, Any] = dict(
    model_type="siglip_vision_model",
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,  # BAGEL runs one fewer
    num_attention_heads=2,
    num_channels=3,
    image_size=32,
    patch_size=4,
    hidden_act="gelu_pytorch_tanh",
    layer_norm_eps=1e-6,
)
TINY_VAE: dict[str, Any] = dict(block_out_channels=[32, 32, 64, 64], layers_per_block=1)
MAX_LATENT_SIZE = 8  # latent patches a side (128 px)

_CORPUS = """
a photo of a red cat sitting on a wooden table in the morning light
the blue car drives along the river under a cloudy sky at sunset
describe the image in detail and answer the question about it
what is in this picture? there is a small dog and a green tree
think about the plan first, then draw the scene step by step
an astronaut rides a horse on the moon, cinematic, detailed, golden
hello, how are you today? I am fine, thank you. Let us talk.
""".split("\n")


def tiny_weights(path: str | os.PathLike | None = None) -> str:
    """Write the tiny checkpoint (once) and return its folder (default ``<cache>/weights/bagel-tiny/v1``)."""
    target = Path(path) if path is not None else cache_dir() / "weights" / TINY_ID / TINY_VERSION
    return materialize(target, write_tiny_checkpoint, marker="ema.safetensors")


def write_tokenizer(folder: Path) -> int:
    """A byte-level BPE tokenizer in Qwen2's files (``tokenizer.json``, ``vocab.json``, ``merges.txt``,
    ``tokenizer_config.json``); returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator([line for line in _CORPUS if line], trainer)
    tok.add_special_tokens(SPECIAL)
    tok.save(str(folder / "tokenizer.json"))
    tok.model.save(str(folder))  # vocab.json + merges.txt
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "unk_token": None,
        "model_max_length": 32768,
        "additional_special_tokens": SPECIAL[1:],
        "errors": "replace",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return tok.get_vocab_size()


def write_tiny_checkpoint(folder: Path, seed: int = SEED) -> None:
    """Write every file of the published layout into ``folder`` (random weights from ``seed``)."""
    write_checkpoint(folder, seed=seed)


def write_checkpoint(
    folder: Path,
    *,
    llm: dict[str, Any] | None = None,
    max_latent_size: int = MAX_LATENT_SIZE,
    dtype: torch.dtype = torch.float32,
    seed: int = SEED,
) -> None:
    """Write a random checkpoint in the published layout at another size: ``llm`` overrides the tiny
    decoder's config (e.g. ``hidden_size``, ``num_hidden_layers``), ``max_latent_size`` the latent
    table's side (16 px a patch), ``dtype`` the stored weights' type (BAGEL-7B-MoT's file is bfloat16);
    the tokenizer, SigLIP tower and VAE stay the tiny ones (benchmarks)."""
    from diffusers import AutoencoderKL
    from safetensors.torch import save_file
    from transformers import Qwen2Config, SiglipVisionConfig

    from fv_bagel.net import BagelNet
    from fv_bagel.vae import flux_config, to_bfl

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(folder)
    llm = {**TINY_LLM, **(llm or {}), "vocab_size": -(-vocab // 16) * 16}
    (folder / "llm_config.json").write_text(json.dumps(llm, indent=2))
    (folder / "vit_config.json").write_text(json.dumps(TINY_VIT, indent=2))
    vit_run = SiglipVisionConfig(**{**TINY_VIT, "num_hidden_layers": TINY_VIT["num_hidden_layers"] - 1})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = BagelNet(
            Qwen2Config(**llm),
            vit_run,
            latent_channels=16,
            max_latent_size=max_latent_size,
            vit_side=TINY_VIT["image_size"] // TINY_VIT["patch_size"],
        )
        for name, p in net.named_parameters():  # random everywhere (LayerNorms and RMSNorms near 1)
            if name.endswith("pos_embed"):
                continue
            with torch.no_grad():
                p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name and p.dim() == 1 and "bias" not in name
                        else 0.2 * torch.randn_like(p))  # fmt: skip
        vae: Any = AutoencoderKL(**flux_config(**TINY_VAE))
    state = {k: v.to(dtype).contiguous() for k, v in net.state_dict().items()}
    save_file(state, str(folder / "ema.safetensors"))
    levels = len(TINY_VAE["block_out_channels"])
    save_file(to_bfl(vae.state_dict(), levels), str(folder / "ae.safetensors"))
