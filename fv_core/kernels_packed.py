"""Attention over packed sequences: several requests' tokens in one sequence, each attending to its own.

A ``packed_attention`` kernel is called as ``kernel(query, key, value, cu_seqlens, scale=None)`` on
``[1, heads, tokens, head_dim]`` tensors whose tokens are segments laid end to end (segment ``i`` is
``cu_seqlens[i]:cu_seqlens[i + 1]``); it returns ``[1, heads, tokens, head_dim]``, each segment's
queries having attended to that segment's keys only. Variants (measured in bench/qwen_image.py; on
this CPU, 4 segments of 296-1640 tokens, 4 heads of 32: segments 0.11 s, sdpa 0.43 s, flex compiled
0.28 s after a 38 s compile, flex uncompiled 4.2 s):

- ``segments``: one SDPA call per segment; each segment's numbers are exactly those of the request
  alone (the same call on the same shapes). Any device.
- ``sdpa``: one SDPA call with a block-diagonal boolean mask: portable, but pays for every pair.
- ``flex``: ``torch.nn.attention.flex_attention`` compiled, with a document mask (skips the blocks
  between segments; the mask is built per call).
- ``padded``: padded batching, for comparison (every request padded to the longest; model code that
  supports it, Qwen-Image, pads when the kernel ``pads``).
- ``varlen``: flash-attn's ``flash_attn_varlen_func`` (CUDA, fp16/bf16), registered only when
  ``flash_attn`` imports.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

import torch
import torch.nn.functional as F


def cu_seqlens(lengths: tuple[int, ...] | list[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """Segment boundaries [N + 1] int32 (0, l0, l0 + l1, ...) for segment ``lengths``."""
    return F.pad(torch.tensor(list(lengths), dtype=torch.int32).cumsum(0, dtype=torch.int32), (1, 0)).to(
        device
    )


def segment_ids(cu: torch.Tensor) -> torch.Tensor:
    """The segment of every token [tokens] (int64) for boundaries ``cu``."""
    lengths = (cu[1:] - cu[:-1]).long()
    return torch.repeat_interleave(torch.arange(len(lengths), device=cu.device), lengths)


def packed_segments(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """One SDPA call per segment (exactly each request's attention alone)."""
    bounds = cu_seqlens.tolist()
    outs = [
        F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], scale=scale)
        for a, b in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    return torch.cat(outs, 2)


packed_segments.row_exact = True  # type: ignore[attr-defined]  # each segment's output is the request's alone


def packed_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """One SDPA call with a block-diagonal boolean mask (every segment its own block)."""
    ids = segment_ids(cu_seqlens.to(query.device))
    mask = ids[:, None] == ids[None, :]
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)


@functools.cache
def _compiled_flex() -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def document_mask(cu_seqlens: torch.Tensor, tokens: int, device: torch.device, compile: bool = True) -> Any:
    """Flex attention's BlockMask letting each token see its own segment only."""
    from torch.nn.attention.flex_attention import create_block_mask

    ids = segment_ids(cu_seqlens.to(device))

    def same_segment(b, h, q, k):  # flex's mask_mod signature
        return ids[q] == ids[k]

    return create_block_mask(same_segment, None, None, tokens, tokens, device=device, _compile=compile)


def packed_flex(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Compiled flex attention with a document mask (blocks between segments are skipped)."""
    block_mask = document_mask(cu_seqlens, query.shape[2], query.device)
    return _compiled_flex()(query, key, value, block_mask=block_mask, scale=scale)


def packed_varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """flash-attn's varlen kernel (tokens of all segments as one [tokens, heads, head_dim] batch)."""
    from flash_attn import flash_attn_varlen_func

    cu = cu_seqlens.to(query.device, torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    out = flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, softmax_scale=scale)
    return out.transpose(0, 1).unsqueeze(0)


def packed_padded(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None = None,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Padded batching, for comparison: segments of one length (each request padded to the longest by
    the model code, which this kernel asks for with ``pads``) as rows of one SDPA call, the padding
    (``valid`` [tokens] False) masked out of every row's keys."""
    if valid is None:
        raise ValueError("the padded kernel needs the mask of real tokens (valid=); the model code pads")
    rows = len(cu_seqlens) - 1
    batch, heads, tokens, dim = query.shape
    q, k, v = (t.view(heads, rows, tokens // rows, dim).transpose(0, 1) for t in (query, key, value))
    mask = valid.view(rows, 1, 1, tokens // rows)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.transpose(0, 1).reshape(batch, heads, tokens, dim)


packed_padded.pads = True  # type: ignore[attr-defined]  # the model code pads every request to the longest


def flash_attn_installed() -> bool:
    """Whether flash-attn is installed here (the ``varlen`` variant is registered only then); found
    without importing it, so registering kernels imports neither it nor torch."""
    return importlib.util.find_spec("flash_attn") is not None
