"""A family's training view of a loaded model: its serve step bodies over modules a method chooses.

Methods never import a family plugin: ``train_adapter(model)`` finds the adapter the card's family
registered (``fv_register_trainers``), and every forward a method takes (prompt conditioning,
velocity) runs the very ``WorkPlan`` bodies the family's serve loop runs, under the serve profile
(no grad) or the train profile (grad). So what a method trains is what the server runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch

from fv_core.errors import ConfigError
from fv_core.model import LoadedModel
from fv_core.plugins import PluginHost, load_plugins


class TrainAdapter(Protocol):
    """What a family offers training methods (fv-wan's ``WanTrainAdapter`` is one)."""

    model: LoadedModel  # the loaded model whose live components are the defaults below
    num_train_timesteps: int  # timestep = sigma * num_train_timesteps

    def module(self, name: str) -> torch.nn.Module:
        """The live component ``name`` (``transformer``, ``text_encoder``, ...)."""
        ...

    def conditioning(
        self, prompts: list[str], text_encoder: torch.nn.Module | None = None, train: bool = False
    ) -> torch.Tensor:
        """Prompt embeddings [B, L, D] exactly as the serve loop builds them."""
        ...

    def velocity(
        self,
        transformer: torch.nn.Module,
        latents: torch.Tensor,
        sigma: torch.Tensor,
        embeds: torch.Tensor,
        train: bool = False,
    ) -> torch.Tensor:
        """The flow velocity the serve loop's denoise body predicts at noise level ``sigma`` [B]."""
        ...

    def noise(self, batch: int, generator: torch.Generator, **params: Any) -> torch.Tensor:
        """Initial latent noise for ``batch`` requests of the card's default (or given) size."""
        ...

    def encode_video(self, video: torch.Tensor) -> torch.Tensor:
        """Normalised latents of pixel video [B, 3, F, H, W] in -1..1 (the decode body inverts this)."""
        ...

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Frames [B, F, H, W, 3] in 0..1 from normalised latents."""
        ...

    def export(self, folder: Path, modules: dict[str, torch.nn.Module], recipe: dict[str, Any]) -> None:
        """A loadable checkpoint in the real layout: ``modules`` replace the loaded model's
        components of the same name, every other file is the loaded model's; ``recipe`` (method,
        parents, steps, ...) is written next to it as ``fv_recipe.json``."""
        ...


def train_adapter(model: LoadedModel, host: PluginHost | None = None, **defaults: Any) -> TrainAdapter:
    """The training adapter of ``model``'s family, bound to it; ``defaults`` override the card's
    request defaults it trains at (e.g. ``max_sequence_length``)."""
    return adapter_class(model.card.family, host)(model, **defaults)


def adapter_class(family: str, host: PluginHost | None = None) -> Any:
    """The adapter class a family registered (its classmethods build fresh checkpoints)."""
    registry = (host if host is not None else load_plugins()).registries.trainers
    if family not in registry:
        known = sorted(str(k) for k in registry)
        raise ConfigError(
            f"model family {family!r} has no training adapter (families with one: {known}). "
            "Fix: train a card of one of those families, or install the family's plugin version that "
            "registers `fv_register_trainers`."
        )
    return registry.get(family)
