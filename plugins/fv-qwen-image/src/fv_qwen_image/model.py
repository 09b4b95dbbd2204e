"""A live Qwen-Image instance: a card bound to a checkpoint folder.

Components load lazily with their library's own ``from_pretrained`` (safetensors only:
``fv_core.weights.load_component``) and are shared by every request on the instance. The instance
owns the text-feature cache (bounded by the card's byte budget, which its resident bytes count for
admission) and each component's weights version, which scopes it. Weight sync comes from the core's
``SyncableComponents``: requests pin every component's version at init and look components up by
version, so a replaced module stays resident while a running request uses it.
"""

from __future__ import annotations

import itertools
import json
import threading
from pathlib import Path
from typing import Any

import torch

from fv_core import ConfigError, WeightsError
from fv_core.cache import FeatureCache
from fv_core.card import ModelCard
from fv_core.weights import (
    SyncableComponents,
    component_folder,
    load_component,
    refuse_pickles,
    weights_fingerprint,
)

_IDS = itertools.count()
WEIGHTED = ("dit", "vae", "text_encoder")  # component kinds with weights (and so a version)


class QwenImageModel(SyncableComponents):
    """Resident components of one card on one checkpoint (the ``instance`` the Qwen-Image loop runs on)."""

    def __init__(
        self,
        card: ModelCard,
        weights: str | Path,
        device: str | torch.device = "cpu",
        kernels: dict[str, tuple[Any, dict[str, Any]]] | None = None,
    ):
        self.card = card
        if card.kernels.get("attention", "sdpa") != "sdpa":
            raise ConfigError(
                f"card {card.model_id!r} selects attention {card.kernels['attention']!r}; Qwen-Image's blocks run "
                "diffusers' own attention (SDPA). Fix: drop the attention kernel from the deploy entry."
            )
        self.kernels = dict(kernels or {})  # op -> (implementation, record); packed_attention packs steps
        self.weights = Path(weights).expanduser()
        if not (self.weights / "model_index.json").is_file():
            raise WeightsError(
                f"{str(self.weights)!r} has no model_index.json. Fix: point at a Qwen-Image folder in the "
                "published diffusers layout (a download of Qwen/Qwen-Image)."
            )
        refuse_pickles(self.weights)
        self.device = torch.device(device)
        self.dtype = getattr(torch, card.precision.default)
        cache = card.caches["text_embeddings"]
        self.feature_cache = FeatureCache(cache.capacity, cache.max_bytes)  # prompt row -> features
        self.weights_versions = {
            name: weights_fingerprint(self.weights, spec.subfolder or name)
            for name, spec in card.components.items()
            if spec.kind in WEIGHTED
        }
        self.scheduler_config = self.config("scheduler/scheduler_config.json")
        self.parallel: Any = None  # single device only (the card declares no parallel axes)
        self._components: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._init_sync()
        self.instance_id = f"{card.model_id}#{next(_IDS)}"  # batch keys: plans on these weights

    def config(self, file: str) -> dict[str, Any]:
        """``component/name.json`` of the checkpoint."""
        component, name = file.split("/", 1)
        return json.loads((component_folder(self.weights, component) / name).read_text())

    def components_for(self, task: str) -> list[str]:
        """Components the card requires for ``task``."""
        if task not in self.card.programs:
            raise ConfigError(
                f"card {self.card.model_id!r} does not serve task {task!r}. Fix: use one of {self.card.tasks}"
            )
        return sorted(n for n, spec in self.card.components.items() if task in spec.required_for)

    def _load(self, name: str) -> Any:
        """Component ``name`` on the device; normal tensors even when first used under inference mode."""
        spec = self.card.components[name]
        if spec.kind == "processor":  # the edit cards' image processor and tokenizer (no weights)
            from fv_qwen_image.vl_encoder import VLProcessor

            return VLProcessor.from_pretrained(component_folder(self.weights, spec.subfolder or name))
        with torch.inference_mode(False):
            module = load_component(self.weights, name, spec, self.dtype)
            if spec.kind == "vae":  # images are single frames: no convolution over time padding
                from fv_qwen_image.vae import frame_convolutions

                module = frame_convolutions(module)
            return module.to(self.device) if isinstance(module, torch.nn.Module) else module

    def kernel_records(self) -> dict[str, Any]:
        packed = {op: record for op, (_, record) in self.kernels.items() if op == "packed_attention"}
        return {"attention": "sdpa", **packed}  # diffusers' own attention processor: torch SDPA

    def resident_bytes(self) -> int:
        """Bytes admission reserves: the resident components plus the feature cache at its budget."""
        cache = self.feature_cache
        return self.weights_bytes() + (cache.nbytes if cache.max_bytes is None else cache.max_bytes)

    def cache_bytes(self) -> dict[str, int]:
        return {"text_embeddings": self.feature_cache.nbytes}

    @property
    def num_blocks(self) -> int:
        """Transformer blocks, read from the folder's config (the transformer need not be loaded)."""
        return int(self.config("transformer/config.json")["num_layers"])

    def loaded(self) -> list[str]:
        return sorted(self._components)

    def release(self, keep: set[str]) -> None:
        """Drop every resident component not in ``keep`` (but synced ones: their weights exist nowhere else)."""
        with self._lock:
            for name in [n for n in self._components if n not in keep and n not in self._synced]:
                del self._components[name]

    def _feature_caches(self) -> tuple[FeatureCache, ...]:
        return (self.feature_cache,)
