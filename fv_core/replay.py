"""Re-running a recorded request: a provenance JSON back into a load and a request.

The provenance holds the resolved params (defaults included), the task, the weights folder,
the kernels, interceptors and plugin options that ran, and the plugins that provided them;
``fv generate --replay out.json`` loads the same way and asks the same, so the frames match
bit for bit on the same machine and versions.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fv_core.deploy.card import DeploymentCard, Limits, ModelDeploy, parse_deploy
from fv_core.errors import ConfigError
from fv_core.plugins import BUILTIN_PLUGIN, PluginHost


@dataclass(frozen=True, slots=True)
class ReplayPlan:
    """How to load and what to ask, read from a provenance file."""

    model: str  # card id or folder that was loaded
    weights: str  # checkpoint folder
    task: str  # the card's task
    params: dict[str, Any]  # every resolved param
    plugin_options: dict[str, dict[str, Any]]  # options to ask for (empty when the deploy holds them)
    deploy: DeploymentCard | None  # kernels, interceptors and options that ran (None: a folder's card)
    adapters: tuple[dict[str, Any], ...] = ()  # the LoRA adapters it ran: name, path, scale (and version)


def replay_plan(host: PluginHost, path: str | Path) -> ReplayPlan:
    """The load and the request recorded in the provenance file ``path``."""
    try:
        prov = json.loads(Path(path).read_text())
        if "workflow" in prov:  # a workflow: its deploy file and params, recorded whole
            return ReplayPlan(prov["workflow"], "", "", prov["params"], {}, parse_deploy(prov["deploy"]))
        model, weights, task, params = prov["model"], prov["weights"], prov["task"], prov["params"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"{str(path)!r} is not a provenance file fv wrote ({type(exc).__name__}: {exc}). "
            "Fix: pass the .json written next to an artifact."
        ) from None
    if prov.get("parts"):
        raise ConfigError(
            f"{str(path)!r} records a request with input parts {prov['parts']}, which a provenance file does "
            "not hold. Fix: run the request again with the same inputs (params are in the file)."
        )
    options = prov.get("plugin_options") or {}
    ran = prov.get("deploy") or {}
    adapters = tuple(prov.get("adapters") or ())
    if model not in host.registries.cards:  # a card built from a folder runs its default kernels
        return ReplayPlan(model, weights, task, params, options, None, adapters)
    deploy = one_model_deploy(
        host,
        model,
        weights,
        ran.get("kernels"),
        prov.get("interceptors") or [],
        options,
        ran.get("limits"),
        ran.get("precision"),
    )
    return ReplayPlan(model, weights, task, params, {}, deploy, adapters)


def one_model_deploy(
    host: PluginHost,
    card: str,
    weights: str | None,
    kernels: Mapping[str, str] | None = None,
    interceptors: Sequence[str] = (),
    plugin_options: Mapping[str, Mapping[str, Any]] | None = None,
    limits: Mapping[str, Any] | None = None,
    precision: str | None = None,
) -> DeploymentCard:
    """A deployment of one card with these kernels, interceptors, options and precision, enabling the
    plugins they need; ``limits`` None: no per-request caps."""
    if card not in host.registries.cards:
        raise ConfigError(
            f"kernels and interceptors are chosen for registered cards; {card!r} is not one. "
            "Fix: load it by card id (see `fv cards`)."
        )
    registries = host.registries
    plugins = {
        registries.cards.plugin_of(card),
        *(registries.interceptors.plugin_of(n) for n in interceptors),
    }
    plugins |= set(plugin_options or {})
    plugins |= kernel_plugins(host, kernels or {})
    parent = host.card(card).parent
    if parent is not None:
        plugins.add(registries.cards.plugin_of(parent))
    return DeploymentCard(
        plugins=sorted(plugins - {BUILTIN_PLUGIN}),
        models=[
            ModelDeploy(
                card=card,
                weights=weights,
                kernels=dict(kernels or {}),
                interceptors=list(interceptors),
                precision=precision,
            )
        ],
        plugin_options={p: dict(o) for p, o in (plugin_options or {}).items()},
        limits=Limits(**limits) if limits is not None else None,
    )


def with_kernels(
    host: PluginHost,
    deploy: DeploymentCard | None,
    model: str | None,
    weights: str | None,
    kernels: Mapping[str, str],
) -> DeploymentCard:
    """``deploy`` (or a one-model deployment without caps) whose entry for ``model`` runs ``kernels``."""
    if deploy is None:
        if model is None or model not in host.registries.cards:
            raise ConfigError(
                f"kernels are chosen for registered cards, and {model or weights!r} is not one (a card built "
                "from a folder runs the default kernels). Fix: pass --model CARD with --weights DIR."
            )
        return one_model_deploy(host, model, weights, kernels)
    deploy = deploy.model_copy(deep=True)
    served = [m for m in deploy.models if model in (None, m.served_name)] or [
        m for m in deploy.models if m.card == model
    ]
    if len(served) != 1:
        names = [m.served_name for m in deploy.models]
        raise ConfigError(
            f"choose one of the deployment's models {names} for the kernels. Fix: pass --model NAME."
        )
    served[0].kernels.update(kernels)
    deploy.plugins = sorted({*deploy.plugins, *kernel_plugins(host, kernels)} - {BUILTIN_PLUGIN})
    return deploy


def kernel_plugins(host: PluginHost, kernels: Mapping[str, str]) -> set[str]:
    """The plugins that register the ``op -> variant`` kernels (on any device)."""
    wanted = set(kernels.items())
    return {
        host.registries.kernels.plugin_of(key)
        for key in host.registries.kernels
        if isinstance(key, tuple) and (key[0], key[3]) in wanted
    }
