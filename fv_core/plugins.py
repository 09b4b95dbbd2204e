"""Plugin discovery and loading (pluggy), behind a typed facade.

Loading policy, from the environment:

- ``FV_PLUGINS``: comma-separated allowlist of plugin (entry point) names;
  when set, only these load.
- ``FV_DISABLE_PLUGINS``: comma-separated blocklist.
- ``FV_TRACE_PLUGINS``: when set (non-empty), every hook call and what it
  registered is printed to stderr.

A plugin that fails to import or to register is recorded in
``PluginHost.errors`` (name, distribution, error) and skipped; the others
still load. Core code never calls ``pm.hook.*`` directly: it uses
``PluginHost.collect()``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from typing import TYPE_CHECKING, Any, Protocol

import pluggy

from fv_core import hookspecs
from fv_core.errors import ConfigError
from fv_core.registry import REGISTRY_NAMES, Registries, resolve_lazy

if TYPE_CHECKING:
    from fv_core.card.spec import ModelCard

__all__ = ["ENTRY_POINT_GROUP", "LoadError", "PluginHost", "PluginInfo", "RunFleet", "load_plugins"]

ENTRY_POINT_GROUP = "fv.plugins"
BUILTIN_PLUGIN = "fv-core"


@dataclass
class PluginInfo:
    """What one plugin is and what it registered."""

    name: str  # entry point name, e.g. "fv-wan"
    distribution: str | None = None  # installed distribution, e.g. "fv-wan"
    version: str | None = None  # distribution version
    hooks: list[str] = field(default_factory=list)  # hooks it implements
    registered: dict[str, list[str]] = field(default_factory=dict)  # registry name -> keys
    error: str | None = None  # load or registration error, if it was skipped


@dataclass
class LoadError:
    """A plugin that was skipped, and why."""

    plugin: str
    distribution: str | None
    stage: str  # "import" or "register"
    error: str

    def __str__(self) -> str:
        dist = f" (distribution {self.distribution})" if self.distribution else ""
        return f"plugin {self.plugin!r}{dist} failed to {self.stage}: {self.error}"


class RunFleet(Protocol):
    """A fleet ``fv_register_fleets`` registers: serve the deploy file on many fv servers behind
    ``host:port`` until stopped; returns the exit code."""

    def __call__(
        self,
        deploy_file: str,
        *,
        host: str,
        port: int,
        data_dir: str | None,
        api_key: str | None,
        device: str,
        address: str | None,
    ) -> int: ...


def _names_from_env(env: Mapping[str, str], var: str) -> set[str] | None:
    raw = env.get(var)
    if raw is None:
        return None
    return {name.strip() for name in raw.split(",") if name.strip()}


class PluginHost:
    """Owns the pluggy manager, the registries and the load report."""

    def __init__(self, env: Mapping[str, str] | None = None):
        self.env = os.environ if env is None else env
        self.pm = pluggy.PluginManager("fv")
        self.pm.add_hookspecs(hookspecs)
        self.registries = Registries()
        self.infos: dict[str, PluginInfo] = {}
        self.errors: list[LoadError] = []
        self.trace = bool(self.env.get("FV_TRACE_PLUGINS"))
        self._collected: set[str] = set()
        from fv_core import builtin

        self.add(builtin, BUILTIN_PLUGIN, distribution="fv-core", version=dist_version("fv-core"))

    # -- discovery ---------------------------------------------------------
    def allowed(self, name: str) -> bool:
        allow = _names_from_env(self.env, "FV_PLUGINS")
        block = _names_from_env(self.env, "FV_DISABLE_PLUGINS") or set()
        return name not in block and (allow is None or name in allow)

    def load_entry_points(self) -> None:
        """Import and register every allowed plugin of the ``fv.plugins`` group."""
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
            if not self.allowed(ep.name) or ep.name in self.infos:
                continue
            dist = ep.dist.name if ep.dist else None
            version = ep.dist.version if ep.dist else None
            try:
                plugin = ep.load()
            except Exception as exc:  # any import failure isolates this plugin only
                self._fail(PluginInfo(ep.name, dist, version), "import", exc)
                continue
            self.add(plugin, ep.name, distribution=dist, version=version)

    def add(
        self, plugin: Any, name: str, distribution: str | None = None, version: str | None = None
    ) -> None:
        """Register an already-imported plugin object (module or instance)."""
        try:
            self.pm.register(plugin, name=name)
            self.pm.check_pending()
        except Exception as exc:
            self._fail(PluginInfo(name, distribution, version), "register", exc)
            return
        hooks = sorted(c.name for c in self.pm.get_hookcallers(plugin) or [])
        self.infos[name] = PluginInfo(name, distribution, version, hooks=hooks)

    # -- collection --------------------------------------------------------
    def collect(self) -> PluginHost:
        """Call every plugin's hooks once; commit each plugin's contributions atomically."""
        for name in list(self.infos):
            if name in self._collected or self.infos[name].error:
                continue
            self._collected.add(name)
            try:
                staged = self._stage(name)
                self._commit(name, staged)
            except Exception as exc:
                self._fail(self.infos[name], "register", exc)
        return self

    def _stage(self, plugin_name: str) -> list[tuple[str, Hashable, Any]]:
        staged: list[tuple[str, Hashable, Any]] = []
        plugin = self.pm.get_plugin(plugin_name)
        for hook_name in hookspecs.HOOK_NAMES:
            for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
                if impl.plugin is not plugin:
                    continue
                registry = hook_name.removeprefix("fv_register_")
                impl.function(register=_Stager(registry, staged))
                if self.trace:
                    keys = [k for r, k, _ in staged if r == registry]
                    print(f"[fv-trace] {plugin_name}.{hook_name} registered {keys}", file=sys.stderr)
        return staged

    def _commit(self, plugin_name: str, staged: list[tuple[str, Hashable, Any]]) -> None:
        done: list[tuple[str, Hashable]] = []
        try:
            for registry_name, key, value in staged:
                if registry_name == "kernels" and not isinstance(value, str):
                    from fv_core.kernels import check_kernel  # imports torch: only for a kernel given whole

                    check_kernel(key, value)  # lazy kernels are checked when first imported
                getattr(self.registries, registry_name).register(key, value, plugin_name)
                done.append((registry_name, key))
        except Exception:  # a bad key: roll back, a skipped plugin contributes nothing
            for registry_name, key in done:
                getattr(self.registries, registry_name).unregister(key, plugin_name)
            raise
        registered: dict[str, list[str]] = {}
        for registry_name, key in done:
            registered.setdefault(registry_name, []).append(key if isinstance(key, str) else repr(key))
        self.infos[plugin_name].registered = registered

    def _fail(self, info: PluginInfo, stage: str, exc: BaseException) -> None:
        info.error = f"{type(exc).__name__}: {exc}"
        self.infos[info.name] = info
        self.errors.append(LoadError(info.name, info.distribution, stage, info.error))
        if self.pm.has_plugin(info.name):
            self.pm.unregister(name=info.name)
        if self.trace:
            print(f"[fv-trace] {self.errors[-1]}", file=sys.stderr)

    # -- queries -----------------------------------------------------------
    def card(self, model_id: str) -> ModelCard:
        """The assembled, validated card ``model_id``."""
        from fv_core.card.assemble import assemble_card

        return assemble_card(self.registries, model_id)

    def fleet(self, name: str) -> RunFleet:
        """The fleet ``name`` (``"ray"``: ``fv serve --ray``) a plugin registered; none is an error
        naming the flag, the plugins that failed to load and the fix."""
        if name not in self.registries.fleets:
            failed = "".join(f"; {e}" for e in self.errors)
            raise ConfigError(
                f"fv serve --{name}: no installed plugin provides the {name!r} fleet (fleets provided: "
                f"{self.registries.fleets.describe_keys()}{failed}); the core serves one process, fleets "
                f"come from plugins (fv_register_fleets). Fix: install the plugin that provides it (--ray: "
                "pip install fv-ray-serve, from this repository pip install -e plugins/fv-ray-serve), or "
                "allow it in FV_PLUGINS / FV_DISABLE_PLUGINS."
            )
        return self.registries.fleets.get(name)

    def require(self, names: list[str]) -> None:
        """Fail with the load error (or absence) of any named plugin."""
        for name in names:
            info = self.infos.get(name)
            if info is None:
                available = ", ".join(sorted(self.infos)) or "(none)"
                raise ConfigError(
                    f"plugin {name!r} is required but not installed or not allowed "
                    f"(FV_PLUGINS/FV_DISABLE_PLUGINS). Loaded: {available}. "
                    f"Fix: pip install the package that provides {name!r}, or remove it from the deploy file."
                )
            if info.error:
                raise ConfigError(f"plugin {name!r} is required but failed to load: {info.error}")
            broken = self._import_errors(name)
            if broken:
                raise ConfigError(f"plugin {name!r} is required but cannot be imported: {'; '.join(broken)}")

    def report(self, imports: bool = False) -> list[dict[str, Any]]:
        """JSON-able description of every plugin, for ``fv plugins``; a lazy registration whose module is
        missing is reported as the plugin's error; with ``imports``, each is imported (torch, Ray, ...), so
        a broken import or a missing name is reported too."""
        return [
            {
                "name": i.name,
                "distribution": i.distribution,
                "version": i.version,
                "hooks": i.hooks,
                "registered": i.registered,
                "contested": self._contested(i.name),
                "error": i.error or "; ".join(self._import_errors(i.name, imports)) or None,
            }
            for i in self.infos.values()
        ]

    def _contested(self, plugin: str) -> dict[str, dict[str, list[str]]]:
        """Registry -> key -> all plugins registering it, for the keys ``plugin`` shares with another."""
        shared: dict[str, dict[str, list[str]]] = {}
        for name in REGISTRY_NAMES:
            for key, entries in getattr(self.registries, name).contested.items():
                plugins = [e.plugin for e in entries]
                if plugin in plugins:
                    shared.setdefault(name, {})[key if isinstance(key, str) else repr(key)] = plugins
        return shared

    def _import_errors(self, plugin: str, imports: bool = True) -> list[str]:
        registries = [getattr(self.registries, name) for name in REGISTRY_NAMES]
        check = "import_errors" if imports else "missing_modules"
        return [error for registry in registries for error in getattr(registry, check)(plugin)]


class _Stager:
    """The ``register`` callable handed to one hook of one plugin."""

    def __init__(self, registry: str, staged: list[tuple[str, Hashable, Any]]):
        self.registry, self.staged = registry, staged

    def __call__(self, *args: Any) -> None:
        key: Hashable
        if self.registry == "cards":
            key, value = _card_entry(*args)
        elif len(args) == 2:
            key, value = args
            key = tuple(key) if isinstance(key, list) else key
        else:
            raise TypeError(f"register() for {self.registry} takes (key, value); got {len(args)} arguments")
        self.staged.append((self.registry, key, value))


def _card_entry(*args: Any) -> tuple[str, Any]:
    """``register(card)``, ``register(factory)`` or ``register(model_id, factory_or_lazy)``."""
    if len(args) == 2:
        return args[0], args[1]
    from fv_core.card.spec import CardVariant, ModelCard  # imports torch: only for a card given whole

    (value,) = args
    card = value if isinstance(value, ModelCard | CardVariant) else resolve_lazy(value)
    card = card() if callable(card) and not isinstance(card, ModelCard | CardVariant) else card
    if not isinstance(card, ModelCard | CardVariant):
        raise TypeError(
            "register() for cards needs a ModelCard, a CardVariant or a factory of one; "
            f"got {type(card).__name__}"
        )
    return card.model_id, card


def dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def load_plugins(env: Mapping[str, str] | None = None) -> PluginHost:
    """Discover installed plugins (entry points) under the loading policy and collect them."""
    host = PluginHost(env)
    host.load_entry_points()
    return host.collect()
