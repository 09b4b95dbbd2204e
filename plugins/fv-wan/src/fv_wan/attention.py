"""Wan self-attention on the attention kernel selected from fv's kernels registry.

:func:`install` puts :class:`KernelSelfAttention` on every block's ``attn1``:
the projections, q/k norms and rope of diffusers' ``WanAttnProcessor``, then the
selected kernel on ``[B, heads, tokens, head_dim]``. Under sequence parallelism each
rank projects its own tokens and the kernel runs on all tokens of its share of the
heads (Ulysses all-to-all before and after). Kernels that work on the
token grid (STA) take ``grid=(frames, height, width)`` of the patched latents
and the card id; ``fv_wan.transformer`` states the grid around each block with
:func:`token_grid`. Text cross-attention (``attn2``) is left as it is.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

from fv_core import ConfigError
from fv_core.parallel import heads_to_seq, seq_to_heads, sequence_parallel

Grid = tuple[int, int, int]

# The latent token grid of the forward running in this context (None outside one).
TOKEN_GRID: ContextVar[Grid | None] = ContextVar("fv_wan_token_grid", default=None)


@contextmanager
def token_grid(grid: Grid) -> Iterator[None]:
    """Self-attention inside this block sees tokens laid out on ``grid``."""
    reset = TOKEN_GRID.set(grid)
    try:
        yield
    finally:
        TOKEN_GRID.reset(reset)


def grid_of(latents: torch.Tensor, patch: tuple[int, int, int]) -> Grid:
    """Token grid of latents ``[B, C, T, H, W]`` patched by ``patch``."""
    return tuple(n // p for n, p in zip(latents.shape[-3:], patch, strict=True))  # type: ignore[return-value]


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's rotary embedding on ``[B, tokens, heads, head_dim]`` (as diffusers applies it)."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


@dataclass(frozen=True, slots=True)
class KernelSelfAttention:
    """A diffusers attention processor for Wan's ``attn1`` that runs ``kernel``."""

    kernel: Callable[..., torch.Tensor]  # core attention signature: (q, k, v, attn_mask, is_causal, scale)
    card: str  # card id, passed to grid kernels (it picks their configured window)
    spatial: bool  # the kernel takes the token ``grid``

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if encoder_hidden_states is not None or attention_mask is not None:
            raise ValueError("KernelSelfAttention serves Wan's unmasked self-attention (attn1) only")
        heads = (attn.heads, -1)
        query = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, heads)
        key = attn.norm_k(attn.to_k(hidden_states)).unflatten(2, heads)
        value = attn.to_v(hidden_states).unflatten(2, heads)
        if rotary_emb is not None:
            query, key = rope(query, *rotary_emb), rope(key, *rotary_emb)
        extra = {"grid": self._grid(), "card": self.card} if self.spatial else {}
        tokens = query.shape[1]
        if sequence_parallel() is not None:  # Ulysses: all tokens, this rank's heads, around the kernel
            tokens = self._tokens()
            query, key, value = (seq_to_heads(t, tokens) for t in (query, key, value))
        out = self.kernel(*(t.transpose(1, 2) for t in (query, key, value)), **extra)
        out = heads_to_seq(out.transpose(1, 2), tokens).flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))

    def _tokens(self) -> int:
        frames, height, width = self._grid()
        return frames * height * width

    def _grid(self) -> Grid:
        grid = TOKEN_GRID.get()
        if grid is None:
            raise ConfigError(
                f"attention kernel {self.kernel!r} needs the latent token grid, and this call gave none "
                "(diffusers' own WanTransformer3DModel.forward does not). "
                "Fix: run the transformer through fv_wan.transformer, which states the grid."
            )
        return grid


def install(transformer: Any, kernel: Callable[..., torch.Tensor], card: str) -> None:
    """Run every block's self-attention of ``transformer`` on ``kernel``."""
    spatial = "grid" in inspect.signature(kernel).parameters
    for block in transformer.blocks:
        block.attn1.set_processor(KernelSelfAttention(kernel, card, spatial))


def describe(kernel: Any, record: dict[str, Any], card: str, grid: Grid | None, probe: torch.Tensor) -> dict:
    """``record`` plus, for a grid kernel at ``grid``, the ``call`` it makes on tensors like ``probe``
    (implementation path, geometry, why a faster path was not taken)."""
    if grid is None or not hasattr(kernel, "path"):
        return dict(record)
    return {**record, "call": kernel.path(probe, kernel.geometry(grid, card)).record()}
