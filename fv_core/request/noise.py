"""Variation seeds for any family's loop: a request's noise turned toward a second seed's.

A family's params subclass :class:`VariationParams` (the two fields; its ``check`` holds their rules,
so a subclass's ``check`` calls ``super().check``), and its loop draws every initial noise through
:class:`NoiseDraws`: each draw from the seed's generator is mixed
with the same draw of the variation seed's generator, so strength 0 is the seed's output and 1 the
variation seed's, bit for bit, whatever the loop draws (video, audio, decode noise, in order).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from pydantic import Field

from fv_core.errors import ConfigError
from fv_core.request.params import MAX_SEED, Params

if TYPE_CHECKING:
    from fv_core.card.spec import ModelCard


class VariationParams(Params):
    """Params of a loop that supports variation seeds."""

    variation_seed: int | None = Field(
        None, ge=0, le=MAX_SEED, description="a second seed whose noise variation_strength mixes in"
    )
    variation_strength: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="how far the noise turns toward variation_seed's (0: seed's output; small: variations of it)",
    )

    def check(self, card: ModelCard, loop_id: str) -> None:
        if self.variation_strength > 0 and self.variation_seed is None:
            raise ConfigError(
                f"variation_strength={self.variation_strength} varies the noise toward variation_seed's, "
                "but variation_seed is not set. Fix: set variation_seed, or variation_strength=0",
                param="variation_strength",
            )
        if self.variation_strength > 0 and self.variation_seed == self.seed:
            raise ConfigError(
                f"variation_seed={self.variation_seed} equals seed: mixing a noise with itself only scales "
                "it. Fix: choose a variation_seed other than seed",
                param="variation_seed",
            )


class NoiseDraws:
    """Standard-normal draws from ``generator`` (the request's seeded CPU generator), each turned
    toward the same draw of the generator of ``params.variation_seed``: ``cos(s pi/2) n + sin(s pi/2)
    m``, still exactly standard normal for any strength ``s``. No variation seed or strength 0: the
    plain draws."""

    def __init__(self, generator: torch.Generator, params: VariationParams):
        self.generator, self.strength = generator, params.variation_strength
        seed = params.variation_seed
        self.variation = None
        if seed is not None and self.strength > 0:
            self.variation = torch.Generator(device="cpu").manual_seed(seed)

    def state(self) -> dict[str, torch.Tensor]:
        """Where the streams stand: a program's next stage continues from it (``restore``), as one
        generator handed through chained pipelines does."""
        states = {"generator": self.generator.get_state()}
        if self.variation is not None:
            states["variation"] = self.variation.get_state()
        return states

    def restore(self, states: dict[str, torch.Tensor]) -> NoiseDraws:
        """Continue the streams ``state()`` saved (the same params: the same streams)."""
        self.generator.set_state(states["generator"].cpu())  # a resumed state may sit on the device
        if self.variation is not None:
            self.variation.set_state(states["variation"].cpu())
        return self

    def randn(self, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        noise = torch.randn(shape, generator=self.generator, dtype=dtype)
        if self.variation is None:
            return noise
        other = torch.randn(shape, generator=self.variation, dtype=dtype)
        angle = self.strength * math.pi / 2
        return math.cos(angle) * noise + math.sin(angle) * other
