"""Which plugin of this repository provides a kernel variant or an interceptor, by name.

Only words: the core imports no plugin. An error about a kernel or an interceptor no loaded plugin
registers adds ``provider_hint`` so it names the package and the command that installs it.
"""

from __future__ import annotations

from fv_core.errors import ConfigError
from fv_core.registry import Registries

# (registry, name) -> the plugin (distribution and folder under plugins/) that registers it
PROVIDERS: dict[tuple[str, str], str] = {
    ("kernels", "sta"): "fv-sta",  # attention variant
    ("interceptors", "fbcache"): "fv-cache-dit",
    ("interceptors", "dbcache"): "fv-cache-dit",
    ("interceptors", "taylorseer"): "fv-cache-dit",
    ("interceptors", "inferix"): "fv-inferix",
}


def provider_hint(registries: Registries, registry: str, name: str) -> str:
    """A sentence naming the plugin that provides ``name`` (an interceptor, or a kernel variant) and how
    to install or allow it; empty when no loaded plugin lacks it or the provider is unknown."""
    plugin = PROVIDERS.get((registry, name))
    if plugin is None or _registered(registries, registry, name):
        return ""
    return (
        f" {name!r} is provided by {plugin}, which is not loaded. Fix: pip install -e plugins/{plugin} (from "
        "this repository), or allow it if it is installed (FV_PLUGINS / FV_DISABLE_PLUGINS)."
    )


def _registered(registries: Registries, registry: str, name: str) -> bool:
    if registry == "kernels":  # a variant registered for any op, device or arch
        return name in _variants(registries)
    return name in getattr(registries, registry)


def _variants(registries: Registries, op: str | None = None) -> set[str]:
    """Kernel variants registered (for ``op``, or any op)."""
    return {key[3] for key in registries.kernels if isinstance(key, tuple) and op in (None, key[0])}


def check_provided(
    registries: Registries, registry: str, name: str, where: str, op: str | None = None
) -> None:
    """ConfigError unless a loaded plugin registers ``name`` (an interceptor, or a kernel variant), naming
    ``where`` it was asked, what is available (for the kernel's ``op``) and, when known, the plugin that
    provides it."""
    if _registered(registries, registry, name):
        return
    names = sorted(_variants(registries, op) if registry == "kernels" else map(str, registries.interceptors))
    raise ConfigError(
        f"{where}: no loaded plugin registers the {registry[:-1]} {name!r} (available: {names or 'none'})."
        + (
            provider_hint(registries, registry, name)
            or " Fix: use one of those, or install the plugin that provides it."
        )
    )
