"""A live Wan model instance: a card bound to a checkpoint folder.

Components load lazily, when a request's work first needs them, and are
shared by every request on the instance: Wan2.2 A14B's low-noise expert is
loaded by the first step that runs on it, CLIP by the first I2V request. The
instance also owns the text-embedding and text K/V FeatureCaches (bounded by
the card's byte budgets, which its resident bytes count for admission) and
each component's weights version, which scopes them, and the kernels it runs: an
attention kernel resolved by the core (``kernels``) runs every block's
self-attention and is reported, with the path each result took, in its metrics.

Weight sync (``fv_core.training.sync_weights``): ``stage_weights`` builds a copy of a
component with new tensors (checked against the live ones), ``swap_weights`` makes it the
live one under a new version at a step boundary. Requests pin every component's version
at init (``state.values["weights_versions"]``) and look components up by version, so the
replaced module stays resident, as a retired version, while a running request uses it;
``release_versions`` frees it once none does.
"""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from fv_core import CacheContract, ConfigError, FeatureCache, ModelCard, WeightsError
from fv_core.cache import RepeatedTail
from fv_core.weights import weights_fingerprint
from fv_wan.attention import describe, grid_of, install
from fv_wan.checkpoint import check_layout, load_component, load_scheduler_config
from fv_wan.variant import WanVariant

_IDS = itertools.count()


class WanModel:
    """Resident components of one card on one checkpoint (the ``instance`` Wan loops run against)."""

    def __init__(
        self,
        card: ModelCard,
        weights: str | Path,
        device: str | torch.device = "cpu",
        kernels: dict[str, tuple[Any, dict[str, Any]]] | None = None,
    ):
        self.card = card
        self.kernels = _check_kernels(card, kernels)  # op -> (impl, selection record); None: diffusers' SDPA
        self.weights = check_layout(weights)
        self.variant = WanVariant.of(self.weights)
        self.device = torch.device(device)
        self.dtype = getattr(torch, card.precision.default)
        self.scheduler_config = load_scheduler_config(self.weights)
        caches = card.caches
        self.feature_cache = _cache(caches["text_embeddings"])  # prompt -> UMT5 embeddings
        # prompt -> per-block text keys/values, put folded (RepeatedTail: without their padding repeats)
        self.kv_cache = _cache(caches["text_kv"], unpack=RepeatedTail.expand)
        self.weights_versions = {
            name: weights_fingerprint(self.weights, spec.subfolder or name)
            for name, spec in card.components.items()
            if spec.kind in ("dit", "vae", "text_encoder", "image_encoder")
        }
        self.parallel: Any = None  # the ParallelGroup its denoise steps run on (fv_core.load sets it)
        self._components: dict[str, Any] = {}
        self._retired: dict[tuple[str, str], Any] = {}  # (component, version) -> replaced module still pinned
        self._synced: set[str] = set()  # components whose live weights came from a sync (never reloaded)
        self._lock = threading.Lock()
        self.instance_id = f"{card.model_id}#{next(_IDS)}"  # batch keys: plans on these weights

    def components_for(self, task: str) -> list[str]:
        """Components the card requires for ``task``."""
        if task not in self.card.programs:
            raise ConfigError(
                f"card {self.card.model_id!r} does not serve task {task!r}. Fix: use one of {self.card.tasks}"
            )
        return sorted(n for n, spec in self.card.components.items() if task in spec.required_for)

    def component(self, name: str, version: str | None = None) -> Any:
        """The live component ``name``, loaded on first use; with ``version``, that version of its
        weights (the live one, or one a weight sync replaced while a request pinned to it runs)."""
        with self._lock:
            if version is not None and version != self.weights_versions.get(name, version):
                retired = self._retired.get((name, version))
                if retired is None:
                    raise ConfigError(
                        f"weights version {version!r} of {name!r} is no longer resident (live: "
                        f"{self.weights_versions[name]!r}): a weight sync replaced it after this request "
                        "started, and no running request held it. Fix: run the request again (it takes the "
                        "live weights)."
                    )
                return retired
            if name not in self._components:
                self._components[name] = self._load(name)
            return self._components[name]

    def _load(self, name: str) -> Any:
        """Component ``name`` from the checkpoint folder, on the device, running the card's kernels. Its
        tensors are normal ones even when first used under ``torch.inference_mode`` (serving), so
        training and train-profile replays can use the same instance."""
        spec = self.card.components[name]
        with torch.inference_mode(False):
            module = load_component(self.weights, spec.subfolder or name, self.dtype)
            if isinstance(module, torch.nn.Module):
                module = module.to(self.device)
        if name in self.variant.experts and self.kernels is not None:
            install(module, self.kernels["attention"][0], self.card.model_id)
        return module

    def kernel_records(self, latents: torch.Tensor | None = None) -> dict[str, Any]:
        """The kernels that ran, for a result's provenance; with ``latents``, the attention call made at
        their token grid (implementation path, geometry, any fallback reason)."""
        if self.kernels is None:
            return {"attention": "sdpa"}  # diffusers' own processor: torch SDPA
        impl, record = self.kernels["attention"]
        grid = None
        if latents is not None:
            grid = grid_of(latents, self.component("transformer").config.patch_size)
        probe = torch.empty(0, dtype=self.dtype, device=self.device)
        return {"attention": describe(impl, record, self.card.model_id, grid, probe)}

    def resident_bytes(self) -> int:
        """Bytes admission reserves for this instance: the resident components' parameters and buffers,
        plus each cache at its byte budget (it may fill to it while admitted requests run)."""
        return self.weights_bytes() + sum(_reserve(c) for c in (self.feature_cache, self.kv_cache))

    def weights_bytes(self) -> int:
        """Bytes of the resident components' parameters and buffers (retired versions included)."""
        resident = [*self._components.values(), *self._retired.values()]
        modules = [m for m in resident if isinstance(m, torch.nn.Module)]
        return sum(t.numel() * t.element_size() for m in modules for t in (*m.parameters(), *m.buffers()))

    def cache_bytes(self) -> dict[str, int]:
        """Bytes each cache holds now."""
        return {"text_embeddings": self.feature_cache.nbytes, "text_kv": self.kv_cache.nbytes}

    def parallel_shape(self) -> dict[str, int]:
        """What a parallel plan is checked against: attention heads (Ulysses shards them) and the
        guidance branches of a step."""
        config = json.loads((self.weights / "transformer" / "config.json").read_text())
        if self.kernels is None:
            raise ConfigError(
                "parallel Wan runs self-attention through fv's kernels. Fix: load it with fv_core.load(...)."
            )
        return {"heads": int(config["num_attention_heads"]), "branches": 2}

    @property
    def num_blocks(self) -> int:
        """Transformer blocks, read from the folder's config (the transformer need not be loaded)."""
        return int(json.loads((self.weights / "transformer" / "config.json").read_text())["num_layers"])

    def loaded(self) -> list[str]:
        """Names of the resident components."""
        return sorted(self._components)

    def release(self, keep: set[str]) -> None:
        """Drop every resident component not in ``keep`` (but synced ones: their weights exist nowhere else)."""
        with self._lock:
            for name in [n for n in self._components if n not in keep and n not in self._synced]:
                del self._components[name]

    def set_weights_version(self, component: str, version: str) -> int:
        """Record new weights for ``component``; drops only the cached features it produced. Returns how many.

        Text keys/values come from the transformer applied to text embeddings, so they go with either.
        """
        old = self.weights_versions[component]
        self.weights_versions[component] = version
        dropped = self.feature_cache.invalidate(component=component, weights_version=old)
        if component == "text_encoder":
            return dropped + self.kv_cache.invalidate()
        return dropped + self.kv_cache.invalidate(component=component, weights_version=old)

    # -- weight sync --------------------------------------------------------------------------------

    def stage_weights(self, component: str, tensors: Mapping[str, torch.Tensor]) -> torch.nn.Module:
        """A new module of ``component``: the live one's weights with ``tensors`` (some or all of its
        ``state_dict()``) in place of their own, each checked against the live one first (name, shape,
        dtype, finite). The live component is untouched: running requests go on with it meanwhile."""
        if component not in self.weights_versions:
            raise ConfigError(
                f"{self.card.model_id!r} has no weights component {component!r} to sync. "
                f"Fix: name one of {sorted(self.weights_versions)}.",
                param="components",
            )
        if self.parallel is not None:
            raise ConfigError(
                f"{self.card.model_id!r} runs its steps on a parallel group ({self.parallel.plan.id}) whose "
                "workers hold their own weights; weight sync swaps this process's only. Fix: sync a model "
                "served without a parallel plan."
            )
        own = self.component(component).state_dict()
        for key, tensor in tensors.items():
            _check_tensor(f"{component}.{key}", tensor, own.get(key), sorted(own))
        # Loaded as a fresh start loads it, so its tensors sit in memory as they would had the server
        # started on these weights: matmul kernels take paths by alignment, and a copy elsewhere
        # (deepcopy) gives other bits. Then the live values (an earlier sync may have changed them)
        # and the new ones are copied in place.
        staged = self._load(component)
        staged.load_state_dict(own)
        staged.load_state_dict(dict(tensors), strict=False)
        return staged

    def swap_weights(
        self, component: str, module: torch.nn.Module, version: str, pinned: set[tuple[str, str]]
    ) -> int:
        """Make ``module`` (from ``stage_weights``) the live ``component`` under ``version``; call it at
        a step boundary. The replaced module stays resident while a request pins its version (in
        ``pinned``: ``(component, version)`` of the live requests). Drops the cached features of the
        replaced version only; returns how many."""
        with self._lock:
            old = self.weights_versions[component]
            if (component, old) in pinned and component in self._components:
                self._retired[component, old] = self._components[component]
            self._components[component] = module
            self._synced.add(component)
        return self.set_weights_version(component, version)

    @property
    def retired_versions(self) -> list[tuple[str, str]]:
        """``(component, version)`` of replaced weights still resident for the requests pinned to them."""
        return sorted(self._retired)

    def release_versions(self, pinned: set[tuple[str, str]]) -> int:
        """Free the retired versions no live request pins (``pinned``), with the features cached from
        them; returns how many cache entries went."""
        with self._lock:
            gone = [key for key in self._retired if key not in pinned]
            for key in gone:
                del self._retired[key]
        caches = (self.feature_cache, self.kv_cache)
        return sum(c.invalidate(component=n, weights_version=v) for n, v in gone for c in caches)


def _cache(contract: CacheContract, **codec: Any) -> FeatureCache:
    return FeatureCache(contract.capacity, contract.max_bytes, **codec)


def _check_tensor(name: str, tensor: Any, live: torch.Tensor | None, known: list[str]) -> None:
    """A synced tensor must replace a live one of the same shape and dtype, with finite values."""
    if live is None:
        raise WeightsError(
            f"tensor {name!r} is not in the live component (it has {len(known)}, e.g. {known[:3]}); a sync "
            "replaces existing weights only. Fix: send names from the component's state_dict()."
        )
    if not isinstance(tensor, torch.Tensor):
        raise WeightsError(f"tensor {name!r} is a {type(tensor).__name__}, not a tensor. Fix: send tensors.")
    if tuple(tensor.shape) != tuple(live.shape):
        raise WeightsError(
            f"tensor {name!r} has shape {tuple(tensor.shape)}; the live one has {tuple(live.shape)}, and a "
            "sync keeps the architecture. Fix: send weights of the served model's configuration."
        )
    if tensor.dtype != live.dtype:
        raise WeightsError(
            f"tensor {name!r} is {str(tensor.dtype).removeprefix('torch.')}; the live one is "
            f"{str(live.dtype).removeprefix('torch.')}, and a sync swaps bits, never casts. Fix: send it as "
            f"tensor.to(torch.{str(live.dtype).removeprefix('torch.')})."
        )
    if tensor.is_floating_point() and not torch.isfinite(tensor).all():
        raise WeightsError(
            f"tensor {name!r} holds NaN or infinite values. Fix: send finite weights (check the trainer's loss)."
        )


def _reserve(cache: FeatureCache) -> int:
    """A cache's share of resident bytes: its budget, or what it holds when it has none."""
    return cache.nbytes if cache.max_bytes is None else cache.max_bytes


def _check_kernels(
    card: ModelCard, kernels: dict[str, tuple[Any, dict[str, Any]]] | None
) -> dict[str, tuple[Any, dict[str, Any]]] | None:
    """Wan runs an attention kernel only; without resolved kernels the card must ask for plain SDPA."""
    if kernels is None:
        variant = card.kernels.get("attention", "sdpa")
        if variant != "sdpa":
            raise ConfigError(
                f"card {card.model_id!r} selects attention {variant!r}, but no kernels were resolved. "
                "Fix: load it with fv_core.load(...), which resolves the card's kernels."
            )
        return None
    if set(kernels) != {"attention"}:
        raise ConfigError(
            f"Wan runs an 'attention' kernel only; got kernels for {sorted(kernels)}. "
            "Fix: select only 'attention' for Wan cards."
        )
    return dict(kernels)
