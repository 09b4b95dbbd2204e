"""Keyed registries filled by plugins.

Keys are stable strings or tuples. Values may be lazy ``"module:attr"``
strings, imported on first use so heavy modules load only when needed.
A key two plugins register is contested: using it names both plugins until the
deploy enables only one; an unknown key lists what is available.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any

from fv_core.errors import DuplicateKeyError, PluginLoadError, UnknownKeyError


def resolve_lazy(value: Any) -> Any:
    """Import ``"package.module:attr"`` strings; return anything else as is."""
    if not (isinstance(value, str) and ":" in value):
        return value
    module_name, _, attr = value.partition(":")
    module = importlib.import_module(module_name)
    target: Any = module
    for part in attr.split("."):
        target = getattr(target, part)
    return target


@dataclass(slots=True)
class Entry:
    """One registered value and who registered it."""

    key: Hashable  # registry key
    value: Any  # object or lazy "module:attr" string
    plugin: str  # name of the registering plugin
    loaded: bool = False  # whether a lazy value was imported already


@dataclass
class Registry:
    """A named mapping from keys to plugin-contributed values."""

    name: str  # "cards", "kernels", "interceptors", ...
    entries: dict[Hashable, Entry] = field(default_factory=dict)

    contested: dict[Hashable, list[Entry]] = field(default_factory=dict)  # keys two plugins registered

    def register(self, key: Hashable, value: Any, plugin: str) -> None:
        """Add ``key``; a key another plugin registered too becomes contested: usable only once the
        deploy enables exactly one of its plugins (never decided by install order)."""
        entry = Entry(key, value, plugin)
        if key in self.entries:
            self.contested[key] = [self.entries.pop(key)]
        if key in self.contested:
            self.contested[key].append(entry)
        else:
            self.entries[key] = entry

    def unregister(self, key: Hashable, plugin: str) -> None:
        """Drop ``plugin``'s value for ``key`` (a plugin whose registration failed contributes nothing)."""
        if key in self.entries and self.entries[key].plugin == plugin:
            del self.entries[key]
            return
        rest = [e for e in self.contested.pop(key, []) if e.plugin != plugin]
        if len(rest) == 1:
            self.entries[key] = rest[0]
        elif rest:
            self.contested[key] = rest

    def settle(self, enabled: set[str]) -> None:
        """Give each contested key to its one enabled plugin (the deploy's ``plugins`` list chooses)."""
        for key, entries in list(self.contested.items()):
            chosen = [e for e in entries if e.plugin in enabled]
            if len(chosen) == 1:
                self.entries[key] = chosen[0]
                del self.contested[key]

    def get(self, key: Hashable) -> Any:
        """The value for ``key``, importing it if lazy."""
        if key in self.contested:
            plugins = [e.plugin for e in self.contested[key]]
            raise DuplicateKeyError(
                f"{self.name} key {key!r} is registered by plugins {plugins}; fv does not pick one by install "
                f"order. Fix: enable only one of them in the deploy file's 'plugins' list, or disable the "
                f"others (FV_DISABLE_PLUGINS={','.join(plugins[1:])})."
            )
        entry = self.entries.get(key)
        if entry is None:
            raise UnknownKeyError(
                f"unknown {self.name} key {key!r}. Available: {self.describe_keys()}. "
                "Fix: use one of these, or install/enable the plugin that provides it."
            )
        if not entry.loaded:
            try:
                entry.value = resolve_lazy(entry.value)
            except (ImportError, AttributeError) as exc:
                raise PluginLoadError(self._unimportable(key, entry, exc)) from exc
            entry.loaded = True
        return entry.value

    def _unimportable(self, key: Hashable, entry: Entry, exc: Exception) -> str:
        return (
            f"{self.name} key {key!r} of plugin {entry.plugin!r} names {entry.value!r}, which cannot be "
            f"imported ({type(exc).__name__}: {exc}). Fix: reinstall {entry.plugin!r}, or disable it "
            f"(FV_DISABLE_PLUGINS={entry.plugin})."
        )

    def import_errors(self, plugin: str) -> list[str]:
        """Why each of ``plugin``'s lazy values cannot be imported (imports them all)."""
        errors = []
        for key in [k for k, e in self.entries.items() if e.plugin == plugin]:
            try:
                self.get(key)
            except PluginLoadError as exc:
                errors.append(str(exc))
        return errors

    def missing_modules(self, plugin: str) -> list[str]:
        """Why each of ``plugin``'s lazy values cannot be imported, found without importing them: its module
        is not there (``import_errors`` imports them, so it also finds a broken import or a missing name)."""
        errors = []
        for key, entry in self.entries.items():
            lazy = isinstance(entry.value, str) and ":" in entry.value
            if entry.plugin != plugin or entry.loaded or not lazy:
                continue
            module = entry.value.partition(":")[0]
            try:  # imports the module's parent packages only
                if importlib.util.find_spec(module) is None:
                    raise ModuleNotFoundError(f"No module named {module!r}")
            except ImportError as exc:
                errors.append(self._unimportable(key, entry, exc))
        return errors

    def plugin_of(self, key: Hashable) -> str:
        self.get(key)
        return self.entries[key].plugin

    def describe_keys(self) -> str:
        return (
            ", ".join(repr(k) for k in sorted([*self.entries, *self.contested], key=repr))
            or "(none registered)"
        )

    def __contains__(self, key: object) -> bool:
        return key in self.entries or key in self.contested

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self.entries)  # usable keys; contested ones answer `in` but not iteration

    def __len__(self) -> int:
        return len(self.entries)


ANY = "any"


def lookup_kernel(kernels: Registry, op: str, device: str, arch: str, variant: str) -> tuple[Hashable, Any]:
    """Find a kernel, preferring exact device/arch matches over ``"any"``.

    Returns ``(key, impl)``; raises ``UnknownKeyError`` listing the variants of
    ``op`` when none fits.
    """
    for key in (
        (op, device, arch, variant),
        (op, device, ANY, variant),
        (op, ANY, arch, variant),
        (op, ANY, ANY, variant),
    ):
        if key in kernels:
            return key, kernels.get(key)
    variants = sorted({k for k in kernels if isinstance(k, tuple) and k[0] == op}, key=repr)
    raise UnknownKeyError(
        f"no kernel for op {op!r} variant {variant!r} on device {device!r} arch {arch!r}. "
        f"Registered for {op!r}: {variants or '(none)'}. Fix: pick one of these variants "
        "or enable the kernel plugin that provides it."
    )


REGISTRY_NAMES = (
    "cards",
    "kernels",
    "interceptors",
    "methods",
    "trainers",
    "rewards",
    "scorers",
    "workflows",
    "datasets",
    "options",
    "pipelines",
    "commands",
    "fleets",
)


@dataclass
class Registries:
    """The core's registries, one per hook."""

    cards: Registry = field(default_factory=lambda: Registry("cards"))
    kernels: Registry = field(default_factory=lambda: Registry("kernels"))
    interceptors: Registry = field(default_factory=lambda: Registry("interceptors"))
    methods: Registry = field(default_factory=lambda: Registry("methods"))
    trainers: Registry = field(default_factory=lambda: Registry("trainers"))
    rewards: Registry = field(default_factory=lambda: Registry("rewards"))
    scorers: Registry = field(default_factory=lambda: Registry("scorers"))
    workflows: Registry = field(default_factory=lambda: Registry("workflows"))
    datasets: Registry = field(default_factory=lambda: Registry("datasets"))
    options: Registry = field(default_factory=lambda: Registry("options"))
    pipelines: Registry = field(default_factory=lambda: Registry("pipelines"))
    commands: Registry = field(default_factory=lambda: Registry("commands"))
    fleets: Registry = field(default_factory=lambda: Registry("fleets"))

    def settle(self, enabled: set[str]) -> None:
        """Resolve contested keys in every registry by the deploy's enabled plugins."""
        for name in REGISTRY_NAMES:
            getattr(self, name).settle(enabled)
