"""Variation seeds: a request's noise turned toward a second seed's by variation_strength."""

from __future__ import annotations

import math

import pytest
import torch
from wan_support import request, run

from fv_core import ConfigError
from fv_core.request import NoiseDraws, VariationParams


def latents(model, **params) -> torch.Tensor:
    return run(model, guidance_scale=1.0, num_inference_steps=2, **params).outputs["latents"]


def test_strength_zero_is_the_seed_and_one_is_the_variation_seed(tiny_model):
    plain, other = latents(tiny_model, seed=3), latents(tiny_model, seed=9)
    assert torch.equal(latents(tiny_model, seed=3, variation_seed=9, variation_strength=0.0), plain)
    assert torch.equal(latents(tiny_model, seed=3, variation_seed=9, variation_strength=1.0), other)
    near = latents(tiny_model, seed=3, variation_seed=9, variation_strength=0.2)
    assert not torch.equal(near, plain)
    assert (near - plain).abs().mean() < (other - plain).abs().mean() / 2  # a variation, not another seed


def test_varied_noise_stays_standard_normal():
    base = torch.randn(200_000, generator=torch.Generator().manual_seed(0))
    params = VariationParams(variation_seed=5, variation_strength=0.5)
    mixed = NoiseDraws(torch.Generator().manual_seed(0), params).randn(200_000)
    assert abs(mixed.std().item() - 1.0) < 0.01 and abs(mixed.mean().item()) < 0.01
    # the correlation with the seed's noise is cos(strength * pi / 2)
    assert abs(torch.corrcoef(torch.stack([base, mixed]))[0, 1].item() - math.cos(math.pi / 4)) < 0.01


def test_a_strength_without_a_variation_seed_is_refused(tiny_model):
    with pytest.raises(ConfigError, match=r"variation_strength=0.3 .*Fix: set variation_seed"):
        request(tiny_model, variation_strength=0.3)
    with pytest.raises(ValueError, match="variation_strength"):
        request(tiny_model, variation_seed=1, variation_strength=1.5)
    with pytest.raises(ConfigError, match=r"variation_seed=4 equals seed.*Fix: choose a variation_seed"):
        request(tiny_model, seed=4, variation_seed=4, variation_strength=0.1)
