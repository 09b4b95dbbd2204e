"""Variation seeds on BAGEL's image loops (t2i, edit): strength 0 is the seed's image, 1 the variation
seed's, small strengths a variation of the seed's."""

from __future__ import annotations

import numpy as np
import pytest

from fv_core import ConfigError
from fv_core.request import ImagePart

PICTURE = ImagePart(np.random.default_rng(1).random((40, 56, 3)).astype(np.float32))


@pytest.mark.parametrize("task", ["t2i", "edit"])
def test_strength_zero_is_the_seed_and_one_is_the_variation_seed(bagel, task):
    def image(**params) -> np.ndarray:
        parts = [PICTURE] if task == "edit" else []
        return bagel.generate(
            task=task, parts=parts, prompt="a red cat", num_inference_steps=3, **params
        ).image

    plain, other = image(seed=3), image(seed=9)
    assert np.array_equal(image(seed=3, variation_seed=9, variation_strength=0.0), plain)
    assert np.array_equal(image(seed=3, variation_seed=9, variation_strength=1.0), other)
    near = image(seed=3, variation_seed=9, variation_strength=0.2)
    assert not np.array_equal(near, plain) and np.abs(near - plain).mean() < np.abs(other - plain).mean()


def test_a_strength_without_a_variation_seed_is_refused(bagel):
    with pytest.raises(ConfigError, match=r"variation_strength=0.5 .*Fix: set variation_seed"):
        bagel.prepare({"prompt": "a cat", "variation_strength": 0.5}, task="t2i")
