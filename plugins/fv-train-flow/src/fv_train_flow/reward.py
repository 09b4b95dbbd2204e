"""The ``shapes-detector`` reward: how well a generated shapes clip shows what its prompt asked for.

Each prompt is parsed as a shapes caption ("a red circle moving left"); the detector
(``fv_train_flow.detect``) reads colour, shape and direction from the frames, and the score is the
weighted mean of the three attribute scores, in 0..1:

- colour and direction: 1 when the detector's reading matches the prompt, else 0;
- shape: hard (1 / 0 on the detector's call) or, with ``soft=True`` (the default), a sigmoid of the
  fill ratio's signed margin to the detector's threshold ``SQUARE_FILL`` (squares want a full
  bounding box, circles pi/4 of it): ``sigmoid((fill - SQUARE_FILL) / temperature)`` for a square,
  one minus that for a circle. At ``temperature`` 0.03 a rounded square at fill 0.88 scores 0.39, a
  sharp one at 0.97 scores 0.93 — so a group whose clips all pass the threshold still ranks its
  sharper squares higher (RL needs differences within a group, not only across the threshold).

A clip where the detector finds no object scores 0 on every attribute. ``weights`` picks what is
rewarded (``{"shape": 1}`` is a shape-only reward; ``soft=False`` with one weight is that
attribute's accuracy, used for evaluation curves). A prompt that is not a shapes caption is an
error naming it.
"""

from __future__ import annotations

import math

import torch
from pydantic import Field

from fv_core import ConfigError
from fv_core.training import StrictModel, validate_options
from fv_train_flow.detect import SQUARE_FILL, Detection, detect
from fv_train_flow.shapes import COLOURS, DIRECTIONS, SHAPES

ATTRIBUTES = ("colour", "shape", "direction")


class ShapesRewardOptions(StrictModel):
    """Options of the ``shapes-detector`` reward."""

    weights: dict[str, float] = {"colour": 1.0, "shape": 1.0, "direction": 1.0}  # per attribute, >= 0
    soft: bool = True  # shape scored by the fill ratio's margin to the threshold, else 1/0
    temperature: float = Field(0.03, gt=0)  # fill-ratio scale of the soft shape score


class ShapesDetectorReward:
    """``reward(frames [B, F, H, W, 3] in 0..1, prompts) -> [B]`` in 0..1; see the module docstring."""

    def __init__(self, **options: object) -> None:
        self.opts = validate_options(ShapesRewardOptions, dict(options), "shapes-detector")
        bad = {k: v for k, v in self.opts.weights.items() if k not in ATTRIBUTES or v < 0}
        if bad or not any(self.opts.weights.values()):
            raise ConfigError(
                f"shapes-detector weights={self.opts.weights} must be non-negative weights of "
                f"{list(ATTRIBUTES)} with at least one above 0 (bad: {bad}). Fix: e.g. "
                "weights: {shape: 1.0} for a shape-only reward"
            )

    def __call__(self, frames: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        if frames.shape[0] != len(prompts):
            raise ConfigError(f"{frames.shape[0]} clips but {len(prompts)} prompts; they must pair up")
        return torch.tensor(
            [self.score(detect(clip), parse(p)) for clip, p in zip(frames, prompts, strict=True)]
        )

    def attribute_scores(self, found: Detection, asked: tuple[str, str, str]) -> dict[str, float]:
        """Per-attribute scores in 0..1 of one detection against the asked (colour, shape, direction)."""
        colour, shape, direction = asked
        if found.colour is None:
            return dict.fromkeys(ATTRIBUTES, 0.0)
        if self.opts.soft and found.fill is not None:
            square = 1 / (1 + math.exp(-(found.fill - SQUARE_FILL) / self.opts.temperature))
            shape_score = square if shape == "square" else 1 - square
        else:
            shape_score = float(found.shape == shape)
        return {
            "colour": float(found.colour == colour),
            "shape": shape_score,
            "direction": float(found.direction == direction),
        }

    def score(self, found: Detection, asked: tuple[str, str, str]) -> float:
        scores, weights = self.attribute_scores(found, asked), self.opts.weights
        return sum(weights.get(a, 0.0) * scores[a] for a in ATTRIBUTES) / sum(weights.values())


def parse(prompt: str) -> tuple[str, str, str]:
    """(colour, shape, direction) of a shapes caption ``a <colour> <shape> moving <direction>``."""
    words = prompt.strip().lower().rstrip(".").split()
    if (
        len(words) == 5
        and words[0] == "a"
        and words[3] == "moving"
        and words[1] in COLOURS
        and words[2] in SHAPES
        and words[4] in DIRECTIONS
    ):
        return words[1], words[2], words[4]
    raise ConfigError(
        f"prompt {prompt!r} is not a shapes caption 'a <colour> <shape> moving <direction>' (colours "
        f"{list(COLOURS)}, shapes {list(SHAPES)}, directions {list(DIRECTIONS)}). Fix: score shapes "
        "prompts only with the shapes-detector reward"
    )
