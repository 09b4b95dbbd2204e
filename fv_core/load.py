"""``fv_core.load``: the one recipe that turns a card id or a checkpoint folder into a LoadedModel.

The server, the CLI, eval, training and the family helpers all call it. A deploy (file or
object) applies its entry's kernels, interceptors, plugin options and limits exactly as
``fv serve`` does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from pydantic import BaseModel

from fv_core.adapters.plane import attach_plane
from fv_core.card.assemble import complete_card
from fv_core.card.spec import ModelCard
from fv_core.deploy.card import DeploymentCard, ModelDeploy, load_deploy
from fv_core.deploy.check import check_deploy, deploy_plugin_options
from fv_core.devices import check_device
from fv_core.errors import ConfigError, WeightsError
from fv_core.hub import Snapshot, allow_patterns, folder_snapshot, is_repo_id, snapshot
from fv_core.kernels_select import select_kernel
from fv_core.model import LoadedModel, OptionsPolicy, unknown_model
from fv_core.parallel.group import WorkerSpec, start_group
from fv_core.parallel.plan import ParallelPlan
from fv_core.plugins import BUILTIN_PLUGIN, PluginHost, dist_version, load_plugins
from fv_core.registry import resolve_lazy
from fv_core.weights import bind_card, family, model_index
from fv_core.workflow.registered import deploy_workflows, workflow_deploy
from fv_core.workflow.run import LoadedWorkflow, bind_workflows

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
    parallel: str | ParallelPlan | None = None,
) -> LoadedModel:
    """Load ``model`` (a card id, a deploy's served name, a diffusers-format folder or a Hugging Face
    repo id) on ``weights``.

    :param weights: checkpoint folder or Hugging Face repo id (``owner/name[@revision]``, read from the
        local cache, downloaded when missing and online); default: the deploy entry's, else the card's
        embedded weights, else its published repo (``weights_repo``). A folder or id alone
        (``model=None``) builds the card from its own configs.
    :param deploy: a deploy file or object whose entry for ``model`` sets kernels, interceptors,
        plugin options and limits.
    :param device: torch device the model runs on; checked against the machine first (ConfigError).
    :param host: loaded plugins (default: every installed plugin under the loading policy).
    :param parallel: a parallel plan (``"sp=2,cfg=2"``; default: the deploy entry's): validated against
        the card and the machine, then its worker processes start (``LoadedModel.close`` stops them).
    """
    check_device(device)
    host = host if host is not None else load_plugins()
    plan = deploy if isinstance(deploy, DeploymentCard) or deploy is None else load_deploy(deploy)
    if plan is not None:
        problems = check_deploy(plan, host, device)
        if problems:
            raise ConfigError("the deployment is invalid:\n" + "\n".join(f"  - {p}" for p in problems))
        if model is not None and str(model) in plan.workflows:
            # a workflow runs as a model does (generate, close)
            return load_workflow(plan, str(model), host, device)  # type: ignore[return-value]
    elif (
        model is not None
        and str(model) in host.registries.workflows
        and str(model) not in host.registries.cards
    ):
        return load(model, deploy=workflow_deploy(host, str(model)), device=device, host=host)
    entry = _entry(plan, model) if plan is not None else None
    name = entry.card if entry is not None else str(model if model is not None else weights)
    weights = weights if weights is not None else (entry.weights if entry is not None else None)
    card, folder, origin = _card_on_weights(host, name, weights)
    if entry is not None and entry.precision is not None:  # checked against the card by check_deploy
        card = card.model_copy(
            update={"precision": card.precision.model_copy(update={"default": entry.precision})}
        )
    options = deploy_plugin_options(host, plan) if plan is not None else {}
    kernels = resolve_kernels(host, card, device, options, entry.kernels if entry is not None else None)
    names = entry.interceptors if entry is not None else []
    instance = resolve_lazy(card.instance_factory)(card, folder, device, kernels=kernels)
    attach_plane(card, instance, entry)
    cards, interceptors = host.registries.cards, host.registries.interceptors
    if not isinstance(parallel, ParallelPlan):
        parallel = ParallelPlan.parse(parallel if parallel is not None else entry.parallel if entry else None)
    group = None
    if not parallel.is_single:
        spec = _worker_spec(host, plan, entry, model, folder, device)
        group = start_group(parallel, card, instance, spec, device)
    return LoadedModel(
        card=card,
        instance=instance,
        weights=str(folder),
        weights_repo=origin.record() if origin is not None else None,
        source=name,
        plugin=cards.plugin_of(card.model_id) if card.model_id in cards else folder_plugin(host, folder),
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
        parallel=group,
    )


def _worker_spec(
    host: PluginHost,
    plan: DeploymentCard | None,
    entry: ModelDeploy | None,
    model: str | Path | None,
    weights: str | Path | None,
    device: str,
) -> WorkerSpec:
    """How a worker loads this same model alone: this load's arguments without the plan."""
    deploy = None
    if plan is not None and entry is not None:
        deploy = plan.model_dump(mode="json")
        deploy["models"] = [entry.model_copy(update={"parallel": None}).model_dump(mode="json")]
    modules = {name: host.pm.get_plugin(name) for name, info in host.infos.items() if not info.error}
    plugins = tuple(
        (name, module.__name__)
        for name, module in modules.items()
        if name != BUILTIN_PLUGIN and isinstance(module, ModuleType)
    )
    name = entry.served_name if entry is not None else (str(model) if model is not None else None)
    return WorkerSpec(name, str(weights) if weights is not None else None, deploy, device, plugins)


def load_workflow(plan: DeploymentCard, workflow_id: str, host: PluginHost, device: str) -> LoadedWorkflow:
    """The deploy file's workflow ``workflow_id`` with every model it runs loaded once (nested workflows
    share them) and the scorers its stages select with."""
    loaded: dict[str, LoadedModel] = {}

    def model_of(name: str) -> LoadedModel:
        if name not in loaded:
            loaded[name] = load(name, deploy=plan, device=device, host=host)
        return loaded[name]

    return bind_workflows(deploy_workflows(plan, host), model_of, host, plan.model_dump(mode="json"))[
        workflow_id
    ]


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


def _card_on_weights(
    host: PluginHost, name: str, weights: str | Path | None
) -> tuple[ModelCard, Path, Snapshot | None]:
    """The card ``name`` bound to its checked folder, or a card built from the folder ``name``; a
    Hugging Face repo id stands for its snapshot's folder (the Snapshot, else None)."""
    if name in host.registries.cards:
        card = host.card(name)
        if weights is None and card.default_weights is not None:
            weights = resolve_lazy(card.default_weights)()
        weights = weights if weights is not None else card.weights_repo
        if weights is None:
            raise ConfigError(
                f"model {name!r} has no embedded weights and names no published repo (weights_repo). Fix: "
                "pass its weights: a folder or a Hugging Face repo id (--weights DIR or OWNER/NAME)."
            )
        origin = snapshot(weights, allow_patterns(card)) if is_repo_id(weights) else None
        folder = origin.folder if origin is not None else Path(str(weights)).expanduser().resolve()
        return bind_card(host.registries, card, folder), folder, origin
    return checkpoint_card(host, name)


def checkpoint_card(host: PluginHost, name: str) -> tuple[ModelCard, Path, Snapshot | None]:
    """The card built from the configs of the checkpoint folder (or Hugging Face repo id) ``name``, its
    folder, and the repo's Snapshot (None for a folder)."""
    origin = folder_snapshot(name) if is_repo_id(name) else None
    folder = origin.folder if origin is not None else Path(name).expanduser().resolve()
    if not folder.is_dir():
        raise unknown_model(name, (str(k) for k in host.registries.cards))
    pipeline = _folder_pipeline(host, folder)
    if pipeline is None:
        readers = sorted(str(k) for k in host.registries.pipelines)
        raise WeightsError(
            f"{str(folder)!r} has no model_index.json, and no installed folder reader recognises its files "
            f"(readers: {readers}). Fix: point at a diffusers-format folder or a published layout one of "
            "them reads, or install the model plugin for it."
        )
    return complete_card(family(host.registries, pipeline, folder).card(folder)), folder, origin


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
    for op, variant in chosen.items():
        if not card.accepts_kernel(op, variant):
            accepted = card.accepts_kernels.get(op)
            raise ConfigError(
                f"kernel {op}={variant!r} is not one {card.model_id!r} runs: its model code accepts "
                + (
                    f"{op} variants {accepted}"
                    if accepted
                    else f"no {op!r} kernel (ops: {sorted(card.accepts_kernels)})"
                )
                + f". Fix: select one of those for {op!r}"
                + (" (or drop the choice)." if accepted else " (drop the choice).")
            )
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


def _folder_pipeline(host: PluginHost, folder: Path) -> Any:
    """The pipeline a checkpoint folder holds: its ``model_index.json`` class, else the first registered
    reader's that ``recognizes(folder)`` (a family whose published layout has no model_index.json);
    None when neither."""
    if (folder / "model_index.json").is_file():
        return model_index(folder).get("_class_name")
    pipelines = host.registries.pipelines
    for pipeline in pipelines:
        recognizes = getattr(pipelines.get(pipeline), "recognizes", None)
        if recognizes is not None and recognizes(folder):
            return pipeline
    return None


def folder_plugin(host: PluginHost, folder: Path) -> str | None:
    """The plugin that reads the checkpoint ``folder`` (None: no installed reader recognises it)."""
    pipeline = _folder_pipeline(host, folder)
    return host.registries.pipelines.plugin_of(pipeline) if pipeline in host.registries.pipelines else None


def _versions(host: PluginHost) -> dict[str, str | None]:
    """Versions of every loaded plugin's distribution and of the model libraries."""
    versions = {i.distribution or i.name: i.version for i in host.infos.values() if not i.error}
    return {**versions, **{lib: dist_version(lib) for lib in LIBRARIES}}
