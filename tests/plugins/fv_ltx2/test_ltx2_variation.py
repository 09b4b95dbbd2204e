"""Variation seeds on LTX-2: every noise the loop draws (video, audio, the refine stage's re-noise)
turns toward the variation seed's together, so strength 1 is that seed's video and soundtrack."""

from __future__ import annotations

import numpy as np
import pytest

import fv_core
from fv_core import ConfigError


@pytest.fixture(scope="module")
def model(ltx_host, ltx_path):
    return fv_core.load("ltx2-tiny", ltx_path, host=ltx_host)


def av(model, task: str = "t2av", **params) -> tuple[np.ndarray, np.ndarray]:
    size = 128 if task == "t2av-two-stage" else 64
    out = model.generate(
        task=task, prompt="a cat playing piano", height=size, width=size, num_inference_steps=2, **params
    )
    return np.asarray(out.frames), np.asarray(out.audio.samples)


@pytest.mark.parametrize("task", ["t2av", "t2av-two-stage"])
def test_strength_zero_is_the_seed_and_one_is_the_variation_seed(model, task):
    plain, other = av(model, task, seed=3), av(model, task, seed=9)
    for strength, expected in ((0.0, plain), (1.0, other)):
        varied = av(model, task, seed=3, variation_seed=9, variation_strength=strength)
        assert all(np.array_equal(a, b) for a, b in zip(varied, expected, strict=True)), strength
    near = av(model, task, seed=3, variation_seed=9, variation_strength=0.2)
    for part, (n, p, o) in enumerate(zip(near, plain, other, strict=True)):  # frames, then audio
        assert not np.array_equal(n, p) and np.abs(n - p).mean() < np.abs(o - p).mean(), part


def test_variation_params_are_checked(model):
    with pytest.raises(ConfigError, match=r"variation_strength=0.3 .*Fix: set variation_seed"):
        model.prepare({"prompt": "a cat", "variation_strength": 0.3})
    with pytest.raises(ConfigError, match=r"variation_seed=4 equals seed.*Fix: choose a variation_seed"):
        model.prepare({"prompt": "a cat", "seed": 4, "variation_seed": 4, "variation_strength": 0.1})
