"""Batch invariance: a row of a batched call gets bit for bit what it gets alone.

Under ``determinism: bitwise`` the engine batches a step only through its ``WorkPlan.invariant_body``.
What makes a batched row differ from the row alone is a reduction whose order changes with the batch:
a GEMM whose kernel path changes with its row count M (on CPU, MKL's small-M paths: one row alone is a
matrix-vector product), a convolution that splits its work by batch, attention that splits keys by
the batch size. A family makes its batched path invariant with these pieces:

- :func:`per_row`: run a cheap op on each row alone (the timestep embedding's one-row GEMMs, a patch
  embedding's convolution), so every row takes exactly its lone path;
- :func:`gemm_rows_invariant`: measured on this device and dtype, whether a GEMM over ``m`` rows gives
  each row the bits it gives inside a taller GEMM (the big per-token linears keep GEMM's speed where it
  does); a loop declares invariance only where it holds;
- :func:`rows_invariant`: the same measurement for any row-wise op (attention at a call's shapes).

The measurements run once per shape on random data and are cached for the process.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

import torch
import torch.nn.functional as F

PROBE_ROWS = (2, 3, 8)  # batch sizes each measurement compares a lone row against
PROBE_SEED = 1234


def per_row(fn: Callable[..., torch.Tensor], *tensors: torch.Tensor) -> torch.Tensor:
    """``fn`` on each row (dim 0) of ``tensors`` alone, concatenated: the lone path for every row."""
    rows = tensors[0].shape[0]
    if rows == 1:
        return fn(*tensors)
    return torch.cat([fn(*(t[i : i + 1] for t in tensors)) for i in range(rows)])


def rows_invariant(
    fn: Callable[[torch.Tensor], torch.Tensor], row_shape: tuple[int, ...], device: str, dtype: torch.dtype
) -> bool:
    """Whether ``fn`` on a batch of rows [B, *row_shape] gives each row the bits it gives alone, for B in
    PROBE_ROWS (measured on random data)."""
    gen = torch.Generator().manual_seed(PROBE_SEED)
    for batch in PROBE_ROWS:
        x = torch.randn(batch, *row_shape, generator=gen).to(device, dtype)
        together = fn(x)
        if any(not torch.equal(fn(x[i : i + 1]), together[i : i + 1]) for i in range(batch)):
            return False
    return True


@lru_cache(maxsize=256)
def gemm_rows_invariant(
    m: int, k: int, n: int, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> bool:
    """Whether a linear ``[m, k] x [k, n]`` computes each of its rows as it does inside a call of
    several such row groups (on CPU with MKL, measured: false for m < 12 unless m is a multiple of 4)."""
    gen = torch.Generator().manual_seed(PROBE_SEED)
    weight = torch.randn(n, k, generator=gen).to(device, dtype)
    bias = torch.randn(n, generator=gen).to(device, dtype)
    return rows_invariant(lambda x: F.linear(x, weight, bias), (m, k), device, dtype)


@lru_cache(maxsize=256)
def attention_rows_invariant(
    heads: int,
    queries: int,
    keys: int,
    head_dim: int,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> bool:
    """Whether scaled dot-product attention over [B, heads, queries | keys, head_dim] computes each row as
    it does alone."""

    def attend(x: torch.Tensor) -> torch.Tensor:
        q, kv = x[:, :, :queries], x[:, :, queries:]
        return F.scaled_dot_product_attention(q, kv, kv)

    return rows_invariant(attend, (heads, queries + keys, head_dim), device, dtype)
