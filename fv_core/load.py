"""``fv_core.load``: the one recipe that turns a card id or a checkpoint folder into a LoadedModel.

The server, the CLI, eval, training and the family helpers all call it. A deploy (file or
object) applies its entry's kernels, interceptors, plugin options and limits exactly as
``fv serve`` does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from fv_core.card.assemble import complete_card
from fv_core.card.spec import ModelCard
from fv_core.card.validate import validate_card
from fv_core.deploy.card import DeploymentCard, ModelDeploy, load_deploy
from fv_core.deploy.check import check_deploy, deploy_plugin_options
from fv_core.errors import ConfigError, WeightsError
from fv_core.kernels_select import select_kernel
from fv_core.model import LoadedModel, OptionsPolicy, unknown_model
from fv_core.plugins import BUILTIN_PLUGIN, PluginHost, dist_version, load_plugins
from fv_core.registry import resolve_lazy

# op -> (implementation, provenance record), as ``select_kernel`` returns them
Kernels = dict[str, tuple[Any, dict[str, Any]]]
LIBRARIES = ("torch", "diffusers", "transformers")  # versions every provenance records


def load(
    model: str | Path | None = None,
    weights: str | Path | None = None,
    *,
    deploy: str | Path | DeploymentCard | None = None,
    device: str = "cpu",
    host: PluginHost | None = None,
) -> LoadedModel:
    """Load ``model`` (a card id, a deploy's served name, or a diffusers-format folder) on ``weights``.

    :param weights: checkpoint folder; default: the deploy entry's, else the card's embedded weights.
        A folder alone (``model=None``) builds the card from its own configs.
    :param deploy: a deploy file or object whose entry for ``model`` sets kernels, interceptors,
        plugin options and limits.
    :param host: loaded plugins (default: every installed plugin under the loading policy).
    """
    host = host if host is not None else load_plugins()
    plan = deploy if isinstance(deploy, DeploymentCard) or deploy is None else load_deploy(deploy)
    if plan is not None:
        problems = check_deploy(plan, host, device)
        if problems:
            raise ConfigError("the deployment is invalid:\n" + "\n".join(f"  - {p}" for p in problems))
    entry = _entry(plan, model) if plan is not None else None
    name = entry.card if entry is not None else str(model if model is not None else weights)
    weights = weights if weights is not None else (entry.weights if entry is not None else None)
    card, folder = _card_on_weights(host, name, weights)
    options = deploy_plugin_options(host, plan) if plan is not None else {}
    kernels = resolve_kernels(host, card, device, options, entry.kernels if entry is not None else None)
    names = entry.interceptors if entry is not None else []
    instance = resolve_lazy(card.instance_factory)(card, folder, device, kernels=kernels)
    cards, interceptors = host.registries.cards, host.registries.interceptors
    return LoadedModel(
        card=card,
        instance=instance,
        weights=str(folder),
        source=name,
        plugin=cards.plugin_of(card.model_id) if card.model_id in cards else _folder_plugin(host, folder),
        kernels={op: record for op, (_, record) in kernels.items()},
        interceptors=build_interceptors(host, names),
        interceptor_names=tuple(names),
        limits=plan.limits if plan is not None else None,
        options=OptionsPolicy(
            schemas={str(p): host.registries.options.get(p) for p in host.registries.options},
            enabled=frozenset(plan.plugins) if plan is not None else None,
            base=dict(plan.plugin_options) if plan is not None else {},
            per_request=frozenset(interceptors.plugin_of(n) for n in interceptors),
        ),
        versions=_versions(host),
        deploy_plugins=list(plan.plugins) if plan is not None else _plugins_used(host, card, kernels),
    )


def _entry(plan: DeploymentCard, model: str | Path | None) -> ModelDeploy:
    """The deploy entry served as ``model`` (else the first running the card ``model``); the only one
    when None."""
    if model is None and len(plan.models) == 1:
        return plan.models[0]
    served = [m for m in plan.models if m.served_name == str(model)]
    matches = served or [m for m in plan.models if m.card == str(model)]
    if not matches:
        names = [m.served_name for m in plan.models]
        raise ConfigError(f"the deployment serves no model {model!r}. Fix: use one of {names}.")
    return matches[0]


def _card_on_weights(host: PluginHost, name: str, weights: str | Path | None) -> tuple[ModelCard, Path]:
    """The card ``name`` bound to its checked folder, or a card built from the folder ``name``."""
    if name in host.registries.cards:
        card = host.card(name)
        if weights is None:
            if card.default_weights is None:
                raise ConfigError(
                    f"model {name!r} has no embedded weights. Fix: pass a weights folder (--weights DIR)."
                )
            weights = resolve_lazy(card.default_weights)()
        folder = Path(str(weights)).expanduser().resolve()
        return bind_card(host, card, folder), folder
    folder = Path(name).expanduser().resolve()
    if not (folder / "model_index.json").is_file():
        raise unknown_model(name, (str(k) for k in host.registries.cards))
    pipeline = _model_index(folder).get("_class_name")
    family = _family(host, pipeline, folder)
    return complete_card(family.card(folder)), folder


def bind_card(host: PluginHost, card: ModelCard, folder: Path) -> ModelCard:
    """``card`` checked against the folder's configs and adapted to them by its family.

    A named card refuses a folder whose configs differ from what it declares (class, layer
    count, dims, scheduler): the message names both values and the fix.
    """
    if not folder.is_dir():
        raise WeightsError(f"weights folder {str(folder)!r} does not exist. Fix: pass an existing folder.")
    checks = []  # (file, key, expected value or list of allowed ones, the folder's value)
    if card.pipeline is not None:
        checks.append(
            ("model_index.json", "_class_name", card.pipeline, _model_index(folder).get("_class_name"))
        )
    for name, spec in card.components.items():
        sub = spec.subfolder or name
        file = f"{sub}/{'scheduler_config.json' if spec.kind == 'scheduler' else 'config.json'}"
        config = _read_json(folder / file) if spec.config else {}
        checks += [(file, key, want, config.get(key)) for key, want in spec.config.items()]
    wrong = [c for c in checks if not (c[3] in c[2] if isinstance(c[2], list) else c[3] == c[2])]
    if wrong:
        lines = "; ".join(
            f"expects {k}={want!r} in {file}, the folder has {k}={got!r}" for file, k, want, got in wrong
        )
        raise WeightsError(
            f"card {card.model_id!r} does not fit {str(folder)!r}: {lines}. Fix: load the folder by path "
            f"(fv_core.load({str(folder)!r}), or `fv generate --weights {folder}` without --model): its card "
            "is built from its own configs."
        )
    if card.pipeline is None or card.pipeline not in host.registries.pipelines:
        return card
    return validate_card(_family(host, card.pipeline, folder).bind(card, folder))


def _family(host: PluginHost, pipeline: Any, folder: Path) -> Any:
    if pipeline not in host.registries.pipelines:
        known = sorted(str(k) for k in host.registries.pipelines)
        raise WeightsError(
            f"{str(folder)!r} holds a {pipeline!r} checkpoint, and no installed plugin reads that "
            f"pipeline (readable: {known}). Fix: install the model plugin for it."
        )
    return host.registries.pipelines.get(pipeline)


def _model_index(folder: Path) -> dict[str, Any]:
    return _read_json(folder / "model_index.json")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise WeightsError(f"{str(path)!r} is missing. Fix: point at a complete checkpoint folder.") from None
    except json.JSONDecodeError as exc:
        raise WeightsError(
            f"{str(path)!r} is not valid JSON ({exc}). Fix: repair or re-download it."
        ) from None


def resolve_kernels(
    host: PluginHost,
    card: ModelCard,
    device: str = "cpu",
    plugin_options: Mapping[str, BaseModel] | None = None,
    requested: Mapping[str, str] | None = None,
) -> Kernels:
    """The card's kernels (``requested`` variants overriding, e.g. a deploy's) selected for ``device``;
    a kernel gets its plugin's validated options."""
    chosen = {**card.kernels, **(requested or {})}
    return {
        op: select_kernel(host.registries, op, variant, device, options=plugin_options)
        for op, variant in chosen.items()
    }


def build_interceptors(host: PluginHost, names: Sequence[str]) -> tuple[Any, ...]:
    """Interceptors by registered name. They read their options from each request (``request.options``)."""
    return tuple(host.registries.interceptors.get(name)() for name in names)


def _plugins_used(host: PluginHost, card: ModelCard, kernels: Kernels) -> list[str]:
    """Plugins a replay of a deploy-less load needs: the card's and its kernels'."""
    cards = host.registries.cards
    names = {cards.plugin_of(c) for c in (card.model_id, card.parent) if c is not None and c in cards}
    names |= {record["plugin"] for _, record in kernels.values()}
    return sorted(names - {BUILTIN_PLUGIN})


def _folder_plugin(host: PluginHost, folder: Path) -> str | None:
    pipeline = _model_index(folder).get("_class_name")
    return host.registries.pipelines.plugin_of(pipeline) if pipeline in host.registries.pipelines else None


def _versions(host: PluginHost) -> dict[str, str | None]:
    """Versions of every loaded plugin's distribution and of the model libraries."""
    versions = {i.distribution or i.name: i.version for i in host.infos.values() if not i.error}
    return {**versions, **{lib: dist_version(lib) for lib in LIBRARIES}}
