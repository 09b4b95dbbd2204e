"""Initial-noise helpers for any family's loop: a seed's noise varied toward a second seed's."""

from __future__ import annotations

import math

import torch


def variation_noise(noise: torch.Tensor, variation_seed: int, strength: float) -> torch.Tensor:
    """``noise`` turned toward ``variation_seed``'s noise by ``strength`` (0: unchanged, 1: that
    seed's): ``cos(s pi/2) noise + sin(s pi/2) other``, still exactly standard normal for any
    strength. Small strengths give variations of the seed's output (its layout, other details).
    ``other`` is drawn as ``noise`` was (CPU generator, float32), of the same shape."""
    other = torch.randn(
        noise.shape, generator=torch.Generator(device="cpu").manual_seed(variation_seed), dtype=torch.float32
    ).to(noise.device, noise.dtype)
    angle = strength * math.pi / 2
    return math.cos(angle) * noise + math.sin(angle) * other
