"""Lossless compact forms of cached tensors, and the bytes a cached value holds.

Text features padded to a fixed length end in a run of bit-identical rows
(every padding position sees the same input). :class:`RepeatedTail` keeps
that run's first row once and rebuilds the full tensor on demand, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# same-size integer dtypes: rows are compared by their bits (-0.0 != 0.0, NaN == NaN)
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True, slots=True)
class RepeatedTail:
    """A tensor whose rows along ``dim`` from ``len(head)`` - 1 on all equal the last row of ``head``."""

    head: torch.Tensor  # the rows up to and including the first row of the repeated run
    length: int  # rows along ``dim`` of the full tensor
    dim: int  # the row dimension (negative: from the end)

    @property
    def nbytes(self) -> int:
        return tensor_bytes(self.head)

    def expand(self) -> torch.Tensor:
        """The full tensor (a fresh, contiguous copy)."""
        last = self.head.narrow(self.dim, self.head.shape[self.dim] - 1, 1)
        sizes = list(self.head.shape)
        sizes[self.dim] = self.length - self.head.shape[self.dim]
        return torch.cat([self.head, last.expand(sizes)], self.dim)


def tail_start(t: torch.Tensor, dim: int) -> int:
    """Index along ``dim`` of the first row of ``t``'s trailing run of bit-identical rows."""
    rows = t.shape[dim]
    bits = t.view(_BITS[t.element_size()]) if t.dtype.is_floating_point else t
    same = (bits == bits.narrow(dim, rows - 1, 1)).movedim(dim, -1).reshape(-1, rows).all(0)
    return rows - int(same.flip(0).int().cumprod(0).sum())  # less the trailing run's length (>= 1)


def fold_tail(t: torch.Tensor, dim: int) -> RepeatedTail:
    """``t`` with its trailing run of bit-identical rows along ``dim`` stored once (always lossless)."""
    return RepeatedTail(t.narrow(dim, 0, tail_start(t, dim) + 1).clone(), t.shape[dim], dim)


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes ``t`` keeps alive: its whole storage (a view pins its base)."""
    return t.untyped_storage().nbytes()


def value_bytes(value: Any) -> int:
    """Bytes a cached value keeps alive: tensors by storage (each storage once), containers summed,
    objects with an ``nbytes`` attribute by it; anything else counts 0."""
    seen: set[int] = set()

    def walk(v: Any) -> int:
        if isinstance(v, torch.Tensor):
            ptr = v.untyped_storage().data_ptr()
            if ptr in seen:
                return 0
            seen.add(ptr)
            return tensor_bytes(v)
        if isinstance(v, dict):
            return sum(walk(x) for x in v.values())
        if isinstance(v, list | tuple):
            return sum(walk(x) for x in v)
        return int(getattr(v, "nbytes", 0))

    return walk(value)


def own_storage(value: Any) -> Any:
    """``value`` with every tensor view of a larger storage copied, so caching it pins only its bytes."""
    if isinstance(value, torch.Tensor):
        return value.clone() if tensor_bytes(value) > value.nbytes else value
    if isinstance(value, dict):
        return {k: own_storage(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(own_storage(v) for v in value)
    return value
