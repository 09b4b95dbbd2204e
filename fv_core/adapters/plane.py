"""The adapter plane: named LoRAs over one resident base, chosen per request.

A served model's plane knows its adapters by name (``add``: a deploy file's ``adapters:``, ``fv
generate --lora``, the admin route), checks each file against the card (components, module names,
shapes) when it is added, and keeps loaded weights in an LRU bounded by a byte budget. A request names
adapters and scales (``uses``); when its first loop starts it holds them (``hold``: loaded again if
evicted, hooks installed on the module versions it pinned) until it leaves (``release``). An adapter a
running request holds is never evicted; a request whose adapters cannot fit the budget fails clearly.

Re-adding a name with another file gives it a new version: running requests finish on the version
they hold, new ones take the new version, and caches keyed by the old version are never served again.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fv_core.adapters.files import LoraWeights, LowRank, read_lora
from fv_core.adapters.rows import AdapterUse, lora_hook
from fv_core.cache import content_hash
from fv_core.errors import ConfigError

DEFAULT_BUDGET_BYTES = 1 << 30
DEFAULT_MAX_PER_REQUEST = 4


@dataclass(frozen=True, slots=True)
class AdapterEntry:
    """A named adapter as the deployment registered it."""

    name: str
    path: str
    scale: float  # scale a request gets when it names no scale
    into: tuple[tuple[str, tuple[str, ...]], ...]  # file component -> the model's components it goes into
    version: str
    components: tuple[str, ...]  # the model's components it targets
    nbytes: int
    rank: int

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "version": self.version,
            "scale": self.scale,
            "components": list(self.components),
            "rank": self.rank,
            "bytes": self.nbytes,
        }


class _Table(dict):
    """One module's adapters (adapter key -> LowRank); shared, never copied with its module."""

    def __deepcopy__(self, memo: dict) -> _Table:
        return self


class AdapterPlane:
    """Named adapters of one model instance (``instance.adapters``)."""

    def __init__(
        self,
        instance: Any,
        contract: Any,
        budget_bytes: int = DEFAULT_BUDGET_BYTES,
        max_per_request: int = DEFAULT_MAX_PER_REQUEST,
    ) -> None:
        self.instance, self.contract = instance, contract
        self.budget_bytes, self.max_per_request = budget_bytes, max_per_request
        self.entries: dict[str, AdapterEntry] = {}  # name -> its current version
        self._known: dict[str, AdapterEntry] = {}  # adapter key -> entry (old versions while held)
        self._loaded: OrderedDict[str, LoraWeights] = OrderedDict()  # adapter key -> weights, LRU first
        self._held: dict[str, set[str]] = {}  # request id -> adapter keys it holds
        self._tables: dict[tuple[str, str], _Table] = {}  # (component, module path) -> its table
        self._lock = threading.RLock()

    # -- registering -------------------------------------------------------------------------

    def add(
        self, name: str, path: str | Path, scale: float = 1.0, into: Mapping[str, Iterable[str]] | None = None
    ) -> AdapterEntry:
        """Register ``path`` as adapter ``name`` (a new version if the name exists). ``into``: the model's
        components each of the file's components goes into (Wan2.2 A14B: ``{"transformer":
        ["transformer", "transformer_2"]}`` for both experts); default, each into itself."""
        self.check_scale(name, scale)
        weights = self._read(path, into)
        mapping = tuple(sorted((k, tuple(v)) for k, v in (into or {}).items()))
        return self._register(name, str(path), scale, mapping, weights)

    def add_weights(self, name: str, weights: LoraWeights, scale: float = 1.0) -> AdapterEntry:
        """Register pairs held in memory as adapter ``name``, checked against the model like a file's: a
        LoRA being trained (``fv_core.adapters.TrainableLora``), whose very tensors the hooks then apply.
        Hold it while it is used: an evicted in-memory adapter has no file to be read back from."""
        self.check_scale(name, scale)
        unknown = sorted(set(weights) - set(self.contract.components))
        if unknown:
            raise ConfigError(
                f"adapter {name!r} targets {unknown}, which this card's adapters may not (they may target "
                f"{self.contract.components}). Fix: train the pairs on one of those components."
            )
        checked = {c: self._checked(f"<{name}>", c, modules) for c, modules in weights.items()}
        return self._register(name, f"<in memory: {name}>", scale, (), checked)

    def _register(
        self, name: str, path: str, scale: float, mapping: tuple, weights: LoraWeights
    ) -> AdapterEntry:
        pairs = [p for modules in weights.values() for p in modules.values()]
        entry = AdapterEntry(
            name=name,
            path=path,
            scale=scale,
            into=mapping,
            version=_fingerprint(weights, mapping),
            components=tuple(sorted(weights)),
            nbytes=sum(p.nbytes for p in pairs),
            rank=max(p.down.shape[0] for p in pairs),
        )
        if entry.nbytes > self.budget_bytes:
            raise ConfigError(
                f"adapter {name!r} needs {entry.nbytes} bytes, over this model's adapter budget of "
                f"{self.budget_bytes}. Fix: raise adapter_budget_bytes in the deploy file."
            )
        with self._lock:
            if name in self.entries:
                self.remove(name)  # its old version stays while running requests hold it
            self.entries[name] = entry
            self._known[f"{name}@{entry.version}"] = entry
            self._store(f"{name}@{entry.version}", weights)
        return entry

    def remove(self, name: str) -> bool:
        """Unregister ``name``: new requests cannot name it; running ones finish on the version they hold."""
        with self._lock:
            entry = self.entries.pop(name, None)
            if entry is not None and not self._holders(f"{name}@{entry.version}"):
                self._evict(f"{name}@{entry.version}")
            return entry is not None

    def known(self, key: str) -> AdapterEntry:
        """The entry of an adapter version a request named (removed or replaced ones included)."""
        return self._known[key]

    def describe(self) -> list[dict[str, Any]]:
        return [e.describe() for e in self.entries.values()]

    # -- requests ----------------------------------------------------------------------------

    def check_scale(self, name: str, scale: Any) -> None:
        low, high = self.contract.scale_range
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not low <= scale <= high:
            raise ConfigError(
                f"adapter {name!r} scale={scale!r} is outside this model's range [{low}, {high}]. "
                f"Fix: a number from {low} to {high} (1 applies the LoRA as trained).",
                param="adapters",
            )

    def uses(self, asked: Iterable[Any]) -> tuple[AdapterUse, ...]:
        """A request's adapters (``"name"``, ``(name, scale)`` or ``{"name", "scale"}``) checked against the
        registered names, the scale range and the per-request count."""
        uses = []
        for item in asked:
            name, scale = _name_scale(item)
            entry = self.entries.get(name)
            if entry is None:
                raise ConfigError(
                    f"adapter {name!r} is not served by this model (it serves {sorted(self.entries) or 'none'}). "
                    "Fix: name one of those, or ask the operator to add it.",
                    param="adapters",
                )
            scale = entry.scale if scale is None else scale
            self.check_scale(name, scale)
            uses.append(AdapterUse(name, entry.version, float(scale), entry.components))
        names = [u.name for u in uses]
        if len(set(names)) != len(names):
            raise ConfigError(
                f"adapters {names} name one twice; each may be named once. Fix: name each once.",
                param="adapters",
            )
        if len(uses) > self.max_per_request:
            raise ConfigError(
                f"{len(uses)} adapters requested; this deployment allows at most {self.max_per_request} per "
                "request. Fix: combine fewer adapters.",
                param="adapters",
            )
        return tuple(uses)

    def hold(self, request_id: str, uses: Iterable[AdapterUse], versions: Mapping[str, str | None]) -> None:
        """Hold ``uses`` for ``request_id`` (loading evicted ones, within the budget) and install their hooks
        on the module versions the request pinned (``versions``: component -> version)."""
        with self._lock:
            held = self._held.setdefault(request_id, set())
            for use in uses:
                key = use.key
                held.add(key)
                if key not in self._loaded:
                    entry = self._known[key]
                    self._store(key, self._read(entry.path, dict(entry.into)))
                self._loaded.move_to_end(key)
                for component in use.components:
                    self._install(component, self.instance.component(component, versions.get(component)))

    def release(self, request_id: str) -> None:
        """``request_id`` left: what it held may be evicted again (removed adapters go now)."""
        with self._lock:
            for key in self._held.pop(request_id, set()):
                entry = self._known[key]
                current = self.entries.get(entry.name) == entry
                if not current and not self._holders(key):
                    self._evict(key)  # its entry stays known: a program's next stage may hold it again

    @property
    def loaded_bytes(self) -> int:
        return sum(self._known[k].nbytes for k in self._loaded)

    # -- internals ---------------------------------------------------------------------------

    def _read(self, path: str | Path, into: Mapping[str, Iterable[str]] | None) -> LoraWeights:
        contract = self.contract
        raw = read_lora(path, contract.loader, contract.components, contract.components[0])
        weights: LoraWeights = {}
        for component, modules in raw.items():
            for target in (into or {}).get(component, [component]):
                if target not in self.instance.card.components:
                    raise ConfigError(
                        f"adapter {str(path)!r}: into names {target!r}, which {self.instance.card.model_id!r} "
                        f"does not have (it has {sorted(self.instance.card.components)}). Fix: name one of those."
                    )
                weights[target] = self._checked(path, target, modules)
        return weights

    def _checked(self, path: str | Path, component: str, modules: dict[str, LowRank]) -> dict[str, LowRank]:
        """``modules`` checked against ``component``'s linears (names, shapes), cast to its dtype and device."""
        model = self.instance.component(component)
        linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        problems = []
        for name, pair in modules.items():
            linear = linears.get(name)
            if linear is None:
                problems.append(f"{component}.{name}: no such linear layer")
            elif pair.down.shape[1] != linear.in_features or pair.up.shape[0] != linear.out_features:
                problems.append(
                    f"{component}.{name}: LoRA {pair.down.shape[1]} -> {pair.up.shape[0]} features, the layer "
                    f"{linear.in_features} -> {linear.out_features}"
                )
        if problems:
            raise ConfigError(
                f"adapter {str(path)!r} does not fit {self.instance.card.model_id!r} ({len(problems)} of "
                f"{len(modules)} modules): {problems[:3]}. Fix: use a LoRA trained for this model "
                "(same family and size)."
            )
        weight = next(iter(linears.values())).weight
        return {
            n: LowRank(p.down.to(weight.device, weight.dtype), p.up.to(weight.device, weight.dtype), p.scale)
            for n, p in modules.items()
        }

    def _store(self, key: str, weights: LoraWeights) -> None:
        """Make room (least recently used, unheld first), then put ``key``'s pairs in the module tables."""
        need = self._known[key].nbytes
        for victim in list(self._loaded):
            if self.loaded_bytes + need <= self.budget_bytes:
                break
            if victim != key and not self._holders(victim):
                self._evict(victim)
        if self.loaded_bytes + need > self.budget_bytes:
            raise ConfigError(
                f"adapter {key!r} ({need} bytes) does not fit the adapter budget ({self.budget_bytes} bytes) "
                f"beside the {self.loaded_bytes} bytes running requests hold. Fix: retry when they finish, or "
                "raise adapter_budget_bytes in the deploy file."
            )
        self._loaded[key] = weights
        for component, modules in weights.items():
            for path, pair in modules.items():
                self._tables.setdefault((component, path), _Table())[key] = pair

    def _evict(self, key: str) -> None:
        for table in self._tables.values():
            table.pop(key, None)
        self._loaded.pop(key, None)

    def _holders(self, key: str) -> bool:
        return any(key in keys for keys in self._held.values())

    def _install(self, component: str, model: torch.nn.Module) -> None:
        """Hook every linear of ``model`` that some adapter targets (once per module object)."""
        for path, module in model.named_modules():
            table = self._tables.get((component, path))
            if table is not None and getattr(module, "fv_adapters", None) is not table:
                if getattr(module, "fv_adapters", None) is None:
                    module.register_forward_hook(lora_hook)
                module.fv_adapters = table
                module.fv_path = f"{component}.{path}"


def attach_plane(card: Any, instance: Any, entry: Any = None) -> None:
    """Give ``instance`` its adapter plane (``instance.adapters``) when its card takes adapters, with the
    deploy entry's adapters added; a deploy entry naming adapters for a card without any is refused."""
    asked = dict(entry.adapters) if entry is not None else {}
    if card.adapters is None:
        if asked:
            raise ConfigError(
                f"the deploy entry for {card.model_id!r} names adapters {sorted(asked)}, but the card takes none. "
                "Fix: drop adapters:, or serve a model that takes them (Wan, LTX-2)."
            )
        return
    budget = entry.adapter_budget_bytes if entry is not None else DEFAULT_BUDGET_BYTES
    most = entry.max_adapters if entry is not None else DEFAULT_MAX_PER_REQUEST
    instance.adapters = AdapterPlane(instance, card.adapters, budget, most)
    for name, spec in asked.items():
        if isinstance(spec, str):
            instance.adapters.add(name, spec)
        else:
            instance.adapters.add(name, spec.path, spec.scale, spec.into)


def _name_scale(item: Any) -> tuple[str, float | None]:
    if isinstance(item, str):
        return item, None
    if isinstance(item, Mapping) and "name" in item and set(item) <= {"name", "scale"}:
        return str(item["name"]), item.get("scale")
    if isinstance(item, tuple | list) and len(item) == 2 and isinstance(item[0], str):
        return item[0], item[1]
    raise ConfigError(
        f"adapter {item!r} is not a name, (name, scale) or {{'name': ..., 'scale': ...}}. Fix: use one of those.",
        param="adapters",
    )


def _fingerprint(weights: LoraWeights, into: tuple) -> str:
    """A short hash of everything that changes what the adapter adds: pairs, their scales, ``into``."""
    parts = [
        (component, path, pair.scale, pair.down, pair.up)
        for component, modules in sorted(weights.items())
        for path, pair in sorted(modules.items())
    ]
    return content_hash(repr(into), *(x for part in parts for x in part))[:12]
