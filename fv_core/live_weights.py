"""Components a hot weight sync (``fv_core.training.sync_weights``) can replace while requests run.

A model instance that mixes in :class:`SyncableComponents` gets what a sync needs of it:
``stage_weights`` builds a copy of a component with new tensors (checked against the live ones),
``swap_weights`` makes it the live one under a new version at a step boundary, and
``release_versions`` frees a replaced module once no running request pins its version. Requests pin
every component's version at init (``state.values["weights_versions"]``) and look components up by
version (``component(name, version)``), so the replaced module stays resident, as a retired version,
while a running request uses it. A new version drops only the cached features of the old one.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import torch

from fv_core.cache import FeatureCache
from fv_core.errors import ConfigError, WeightsError


class SyncableComponents:
    """Live components, by version, that weight syncs replace.

    The class mixing it in sets ``card``, ``weights_versions`` (component -> version), ``parallel``,
    ``_components`` (name -> live module) and ``_lock`` (a ``threading.Lock``), calls ``_init_sync()``,
    and implements ``_load(name)``: the component as a fresh load makes it. Its feature caches
    (``_feature_caches``) key each entry by the component and version that produced it;
    ``_replace_features`` is where a family drops what else a new version makes stale.
    """

    card: Any
    weights_versions: dict[str, str]
    parallel: Any
    _components: dict[str, Any]
    _lock: threading.Lock

    def _init_sync(self) -> None:
        self._retired: dict[tuple[str, str], Any] = {}  # (component, version) -> replaced module still pinned
        self._synced: set[str] = set()  # components whose live weights came from a sync (never reloaded)

    def _load(self, name: str) -> Any:
        raise NotImplementedError

    def _syncable(self) -> list[str]:
        """The components a sync may replace: those with a weights version (a family narrows it)."""
        return sorted(self.weights_versions)

    def _feature_caches(self) -> tuple[FeatureCache, ...]:
        """The caches whose entries are keyed by the component and weights version that made them."""
        return ()

    def _drop_features(self, component: str, version: str) -> int:
        """Drop what ``version`` of ``component`` produced: it was replaced, or its retired module freed.
        Returns how many cache entries went."""
        return sum(c.invalidate(component=component, weights_version=version) for c in self._feature_caches())

    def _replace_features(self, component: str, old: str) -> int:
        """Drop what a new version of ``component`` makes stale (``old``: the version it replaces)."""
        return self._drop_features(component, old)

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

    def weights_bytes(self) -> int:
        """Bytes of the resident components' parameters and buffers (retired versions included)."""
        resident = [*self._components.values(), *self._retired.values()]
        modules = [m for m in resident if isinstance(m, torch.nn.Module)]
        return sum(t.numel() * t.element_size() for m in modules for t in (*m.parameters(), *m.buffers()))

    def set_weights_version(self, component: str, version: str) -> int:
        """Record new weights for ``component``; drops only the cached features they make stale.
        Returns how many."""
        old = self.weights_versions[component]
        self.weights_versions[component] = version
        return self._replace_features(component, old)

    def stage_weights(self, component: str, tensors: Mapping[str, torch.Tensor]) -> torch.nn.Module:
        """A new module of ``component``: the live one's weights with ``tensors`` (some or all of its
        ``state_dict()``) in place of their own, each checked against the live one first (name, shape,
        dtype, finite). The live component is untouched: running requests go on with it meanwhile."""
        if component not in self._syncable():
            raise ConfigError(
                f"{self.card.model_id!r} has no weights component {component!r} to sync. "
                f"Fix: name one of {self._syncable()}.",
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
            check_tensor(f"{component}.{key}", tensor, own.get(key), sorted(own))
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
            self.weights_versions[component] = (
                version  # with the module: no lookup sees one without the other
            )
        return self._replace_features(component, old)

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
        return sum(self._drop_features(n, v) for n, v in gone)


def check_tensor(name: str, tensor: Any, live: torch.Tensor | None, known: list[str]) -> None:
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


__all__ = ["SyncableComponents", "check_tensor"]
