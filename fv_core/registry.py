"""Keyed registries filled by plugins.

Keys are stable strings or tuples. Values may be lazy ``"module:attr"``
strings, imported on first use so heavy modules load only when needed.
A duplicate key names both plugins; an unknown key lists what is available.
"""

from __future__ import annotations

import importlib
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

    name: str  # "cards", "components", "kernels", ...
    entries: dict[Hashable, Entry] = field(default_factory=dict)

    def register(self, key: Hashable, value: Any, plugin: str) -> None:
        if key in self.entries:
            other = self.entries[key].plugin
            raise DuplicateKeyError(
                f"{self.name} key {key!r} is registered by both plugin {other!r} and plugin {plugin!r}. "
                f"Fix: disable one of them (FV_DISABLE_PLUGINS={plugin}) or rename the key."
            )
        self.entries[key] = Entry(key, value, plugin)

    def get(self, key: Hashable) -> Any:
        """The value for ``key``, importing it if lazy."""
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
                raise PluginLoadError(
                    f"{self.name} key {key!r} of plugin {entry.plugin!r} names {entry.value!r}, which cannot be "
                    f"imported ({type(exc).__name__}: {exc}). Fix: reinstall {entry.plugin!r}, or disable it "
                    f"(FV_DISABLE_PLUGINS={entry.plugin})."
                ) from exc
            entry.loaded = True
        return entry.value

    def import_errors(self, plugin: str) -> list[str]:
        """Why each of ``plugin``'s lazy values cannot be imported (imports them all)."""
        errors = []
        for key in [k for k, e in self.entries.items() if e.plugin == plugin]:
            try:
                self.get(key)
            except PluginLoadError as exc:
                errors.append(str(exc))
        return errors

    def plugin_of(self, key: Hashable) -> str:
        self.get(key)
        return self.entries[key].plugin

    def describe_keys(self) -> str:
        return ", ".join(repr(k) for k in sorted(self.entries, key=repr)) or "(none registered)"

    def __contains__(self, key: object) -> bool:
        return key in self.entries

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self.entries)

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
    "components",
    "kernels",
    "loops",
    "interceptors",
    "methods",
    "options",
    "pipelines",
    "commands",
)


@dataclass
class Registries:
    """The core's registries, one per hook."""

    cards: Registry = field(default_factory=lambda: Registry("cards"))
    components: Registry = field(default_factory=lambda: Registry("components"))
    kernels: Registry = field(default_factory=lambda: Registry("kernels"))
    loops: Registry = field(default_factory=lambda: Registry("loops"))
    interceptors: Registry = field(default_factory=lambda: Registry("interceptors"))
    methods: Registry = field(default_factory=lambda: Registry("methods"))
    options: Registry = field(default_factory=lambda: Registry("options"))
    pipelines: Registry = field(default_factory=lambda: Registry("pipelines"))
    commands: Registry = field(default_factory=lambda: Registry("commands"))
