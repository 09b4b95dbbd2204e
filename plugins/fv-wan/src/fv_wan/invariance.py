"""Where Wan's steps are batch-invariant on this device: the measurements ``WanLoop`` declares a plan's
``invariant_body`` from (``fv_core.loop.gemm_rows_invariant`` / ``attention_rows_invariant`` at the
step's shapes, cached per shape)."""

from __future__ import annotations

import math

import torch

from fv_core.loop import attention_rows_invariant, gemm_rows_invariant


def gemm_invariant(inst, rows: int, width: int) -> bool:
    """Whether a GEMM over a row of ``rows`` tokens of ``width`` is row-invariant on ``inst``'s device."""
    return gemm_rows_invariant(rows, width, width, str(inst.device), inst.dtype)


def denoise_rows_invariant(
    inst, expert: str, timestep: torch.Tensor, latents: torch.Tensor, keys: tuple
) -> bool:
    """Whether a denoise row of ``latents`` batches row-invariantly: SDPA attention (the card's kernel),
    and the device's GEMM and attention measured row-invariant at its tokens, over itself and over each
    of ``keys`` (text, image) positions."""
    if inst.card.kernels.get("attention", "sdpa") != "sdpa":
        return False
    config = inst.component(expert).config
    heads, head_dim = config.num_attention_heads, config.attention_head_dim
    tokens = math.prod(n // p for n, p in zip(latents.shape[2:], config.patch_size, strict=True))
    device, dtype = str(inst.device), inst.dtype
    per_token = timestep.ndim == 2  # TI2V: the timestep embedding's GEMM runs over the tokens
    return (
        gemm_invariant(inst, tokens, heads * head_dim)
        and (not per_token or gemm_invariant(inst, tokens, config.freq_dim))
        and all(attention_rows_invariant(heads, tokens, n, head_dim, device, dtype) for n in (tokens, *keys))
    )
