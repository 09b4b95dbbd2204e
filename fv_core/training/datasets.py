"""Datasets: real videos with captions for training methods (a GAN's real side), registered by plugins."""

from __future__ import annotations

from typing import Protocol

import torch

from fv_core.plugins import PluginHost, load_plugins


class Dataset(Protocol):
    """Clips ``index .. index + size`` of the stream ``seed``: videos [B, 3, F, H, W] in -1..1 and captions."""

    def batch(self, seed: int, index: int, size: int) -> tuple[torch.Tensor, list[str]]: ...


def load_dataset(name: str, host: PluginHost | None = None) -> Dataset:
    """The dataset a plugin registered as ``name`` (``fv_register_datasets``)."""
    return (host if host is not None else load_plugins()).registries.datasets.get(name)()
