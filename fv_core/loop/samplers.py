"""Flow-matching sampler helpers (pure functions, no state)."""

from __future__ import annotations

import torch


def flow_match_sigmas(steps: int, shift: float = 1.0) -> torch.Tensor:
    """``steps + 1`` sigmas from 1 to 0, warped by ``shift * s / (1 + (shift - 1) * s)``."""
    if steps < 1:
        raise ValueError(f"steps={steps} must be >= 1")
    s = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)
    return (shift * s / (1 + (shift - 1) * s)).to(torch.float32)


def euler_step(x: torch.Tensor, velocity: torch.Tensor, sigma: float, sigma_next: float) -> torch.Tensor:
    """One flow-matching Euler step ``x + (sigma_next - sigma) * v``."""
    return x + (sigma_next - sigma) * velocity
