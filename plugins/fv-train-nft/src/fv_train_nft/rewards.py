"""The ``constant`` reward: ``value`` for every sample, whatever it shows (the control of a reward
run: group advantages are all zero, so r = 1/2 everywhere)."""

from __future__ import annotations

import torch


class ConstantReward:
    def __init__(self, value: float = 1.0) -> None:
        self.value = float(value)

    def __call__(self, frames: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        return torch.full((frames.shape[0],), self.value)
