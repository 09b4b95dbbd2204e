"""Numeric comparison helpers; every one returns the number, never just a bool."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest elementwise ``|a - b|`` (in float64)."""
    _check_shapes(a, b)
    if a.numel() == 0:
        return 0.0
    return (a.detach().double() - b.detach().double()).abs().max().item()


def max_rel(a: torch.Tensor, b: torch.Tensor, eps: float = 1e-12) -> float:
    """``max|a - b| / max|b|``: the error relative to the reference ``b``'s scale."""
    scale = b.detach().double().abs().max().item() if b.numel() else 0.0
    return max_abs(a, b) / max(scale, eps)


def psnr(a: torch.Tensor, b: torch.Tensor, data_range: float | None = None) -> float:
    """Peak signal-to-noise ratio in dB of ``a`` against reference ``b`` (inf when equal)."""
    _check_shapes(a, b)
    a64, b64 = a.detach().double(), b.detach().double()
    mse = (a64 - b64).pow(2).mean().item()
    if mse == 0:
        return math.inf
    rng = data_range if data_range is not None else (b64.max() - b64.min()).item() or 1.0
    return 10 * math.log10(rng**2 / mse)


def leaves(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """Flatten nested dicts / lists / tuples into ``(path, leaf)`` pairs."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from leaves(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from leaves(v, f"{path}[{i}]")
    else:
        yield path, value


def _check_shapes(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch: {tuple(a.shape)} vs {tuple(b.shape)}")
