"""Rewards: models that score generated samples for RL methods, registered by plugins."""

from __future__ import annotations

from typing import Protocol

import torch

from fv_core.plugins import PluginHost, load_plugins


class Reward(Protocol):
    """Scores frames [B, F, H, W, 3] (0..1) against the prompts that asked for them: a tensor [B]."""

    def __call__(self, frames: torch.Tensor, prompts: list[str]) -> torch.Tensor: ...


def load_reward(name: str, host: PluginHost | None = None, **options: object) -> Reward:
    """The reward a plugin registered as ``name`` (``fv_register_rewards``), built with ``options``."""
    factory = (host if host is not None else load_plugins()).registries.rewards.get(name)
    return factory(**options)
