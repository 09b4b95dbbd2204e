"""Checks that tie a deploy file to what is installed, and the request trust boundary."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from fv_core.adapters.files import PICKLES
from fv_core.card.assemble import assemble_card, interceptor_kind
from fv_core.deploy.card import DeploymentCard, ModelDeploy
from fv_core.errors import ConfigError, WeightsError, explain
from fv_core.hub import is_repo_id
from fv_core.kernels_select import device_arch
from fv_core.loop.seam import KIND_NEEDS
from fv_core.plugins import BUILTIN_PLUGIN, PluginHost
from fv_core.providers import check_provided
from fv_core.registry import lookup_kernel
from fv_core.weights import bind_card, refuse_pickles
from fv_core.workflow.check import check_workflow
from fv_core.workflow.registered import deploy_workflows


def check_deploy(deploy: DeploymentCard, host: PluginHost, device: str = "cpu") -> list[str]:
    """Every problem of ``deploy`` against the loaded plugins on ``device`` (empty: valid)."""
    device, arch = device_arch(device)
    problems: list[str] = []

    def attempt(fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except (ConfigError, LookupError, ValueError, ImportError) as exc:
            problems.append(str(exc))

    attempt(host.require, deploy.plugins)
    enabled = set(deploy.plugins) | {BUILTIN_PLUGIN}
    host.registries.settle(enabled)  # a key two plugins register goes to the one this deploy enables
    for i in range(len(deploy.models)):
        attempt(_check_model, deploy, host, i, enabled, device, arch)
    for plugin, options in deploy.plugin_options.items():
        if plugin in host.infos or plugin not in deploy.plugins:  # a missing plugin: reported by require
            attempt(validate_plugin_options, host, deploy, plugin, options)
    names = [m.served_name for m in deploy.models]
    if len(set(names)) != len(names):
        problems.append(f"models: served names {names} repeat. Fix: give each model a unique 'name'.")
    try:
        workflows = deploy_workflows(deploy, host)
    except (ConfigError, LookupError) as exc:
        return [*problems, str(exc)]
    for workflow_id in workflows:
        if workflow_id in names:
            problems.append(
                f"workflows.{workflow_id}: a served model has that name. Fix: rename the workflow."
            )
        attempt(
            check_workflow,
            workflow_id,
            workflows,
            _card_of(deploy, host),
            set(map(str, host.registries.scorers)),
        )
    return problems


def _card_of(deploy: DeploymentCard, host: PluginHost) -> Any:
    """Served name -> the card it runs (KeyError: not served)."""

    def card_of(name: str) -> Any:
        entry = {m.served_name: m for m in deploy.models}[name]
        if entry.card in host.registries.cards:
            return assemble_card(host.registries, entry.card)
        from fv_core.load import checkpoint_card  # a checkpoint entry: the card its configs make

        return checkpoint_card(host, entry.card)[0]

    return card_of


def _check_model(
    deploy: DeploymentCard, host: PluginHost, index: int, enabled: set[str], device: str, arch: str
) -> None:
    model = deploy.models[index]
    where = f"models[{index}]"
    registries = host.registries
    if model.card not in registries.cards and (
        is_repo_id(model.card) or Path(model.card).expanduser().is_dir()
    ):
        _check_checkpoint(host, model, where, enabled)
        return
    _check_enabled(host, "cards", model.card, enabled, f"{where}.card")
    card = assemble_card(registries, model.card)
    for op, variant in model.kernels.items():
        check_provided(
            registries, "kernels", variant, f"{where}.kernels.{op}", op
        )  # names the plugin to install
        key, _ = lookup_kernel(registries.kernels, op, device, arch, variant)
        _check_enabled(host, "kernels", key, enabled, f"{where}.kernels.{op}")
    for name in model.interceptors:
        check_provided(registries, "interceptors", name, f"{where}.interceptors")
        _check_enabled(host, "interceptors", name, enabled, f"{where}.interceptors")
        kind = interceptor_kind(registries, name)
        if kind != "observer" and kind not in card.capabilities.interceptors:
            raise ConfigError(
                f"{where}.interceptors: card {card.model_id!r} rejects {name!r} (a {kind} interceptor"
                f"{': ' + KIND_NEEDS[kind] if kind in KIND_NEEDS else ''}); it accepts "
                f"{sorted(card.capabilities.interceptors) or 'none'}. Fix: remove {name!r} from this model."
            )
    check_precision(card, model.precision, f"{where}.precision")
    _check_adapters(card, model, where)
    # the folder, as load will check it: layout, no pickles, configs vs card (a repo id's, once fetched)
    if model.weights is not None and not is_repo_id(model.weights):
        folder = Path(model.weights).expanduser()
        try:
            bind_card(registries, card, folder)  # the folder exists and its configs fit the card
            refuse_pickles(folder)
        except WeightsError as exc:
            raise WeightsError(f"{where}.weights: {exc}") from None


def _check_adapters(card: Any, model: ModelDeploy, where: str) -> None:
    """Adapters on a card that takes them, each a LoRA file or folder that exists, safetensors only (load
    reads and checks their modules against the model)."""
    if model.adapters and card.adapters is None:
        raise ConfigError(
            f"{where}.adapters: card {card.model_id!r} takes no LoRA adapters. Fix: drop adapters from this model."
        )
    for name, spec in model.adapters.items():
        path = Path(spec if isinstance(spec, str) else spec.path).expanduser()
        if path.suffix in PICKLES or not path.exists():
            problem = "is a pickle file (fv reads safetensors only)" if path.exists() else "does not exist"
            raise ConfigError(
                f"{where}.adapters.{name}: {str(path)!r} {problem}. Fix: give a LoRA .safetensors file or folder."
            )


def _check_checkpoint(host: PluginHost, model: ModelDeploy, where: str, enabled: set[str]) -> None:
    """An entry whose ``card`` is a checkpoint folder or a Hugging Face repo id (its card built from its
    configs at load, as ``fv serve FOLDER|ID`` writes it): it sets nothing a card chooses, and the plugin
    reading a folder is enabled (a repo id's, once fetched)."""
    chosen = [f for f in ("weights", "kernels", "interceptors", "precision") if getattr(model, f)]
    if chosen:
        raise ConfigError(
            f"{where}: card {model.card!r} is a checkpoint, served on the card built from its configs, and sets "
            f"{chosen}, which are chosen on a registered card. Fix: name its card (`fv cards`) with "
            f"weights: {model.card}, or drop {chosen}."
        )
    if is_repo_id(model.card):
        return
    folder = Path(model.card).expanduser()
    plugin = checkpoint_plugin(host, folder, f"{where}.card")
    if plugin not in enabled:
        raise ConfigError(
            f"{where}.card: {model.card!r} is read by plugin {plugin!r}, which this deploy does not enable. "
            f"Fix: add {plugin!r} to 'plugins'."
        )
    refuse_pickles(folder)


def checkpoint_plugin(host: PluginHost, folder: Path, where: str) -> str:
    """The plugin that reads the checkpoint ``folder``; none is an error naming the installed readers."""
    from fv_core.load import folder_plugin

    plugin = folder_plugin(host, folder)
    if plugin is None:
        readers = sorted(str(k) for k in host.registries.pipelines)
        raise WeightsError(
            f"{where}: {str(folder)!r} has no model_index.json, and no installed folder reader recognises its "
            f"files (readers: {readers}). Fix: point at a diffusers-format folder or a published layout one of "
            "them reads, or install the model plugin for it."
        )
    return plugin


def check_precision(card: Any, precision: str | None, where: str) -> None:
    """``precision`` (None: the card's default) is one the card supports."""
    if precision is not None and precision not in card.precision.supported:
        raise ConfigError(
            f"{where}: card {card.model_id!r} runs in {card.precision.supported}, not {precision!r}. "
            f"Fix: use one of {card.precision.supported}, or drop it for the default {card.precision.default!r}."
        )


def _check_enabled(host: PluginHost, registry: str, key: Any, enabled: set[str], where: str) -> None:
    plugin = getattr(host.registries, registry).plugin_of(key)
    if plugin not in enabled:
        raise ConfigError(
            f"{where}: {key!r} comes from plugin {plugin!r}, which this deploy does not enable. "
            f"Fix: add {plugin!r} to 'plugins'."
        )


def validate_plugin_options(
    host: PluginHost, deploy: DeploymentCard, plugin: str, options: dict[str, Any]
) -> BaseModel:
    """Options for ``plugin`` checked against its schema; only deploy-enabled plugins may be set.

    This is the request trust boundary too: a request's plugin options pass
    through here before they reach any plugin.
    """
    if plugin not in deploy.plugins:
        raise ConfigError(
            f"plugin options name {plugin!r}, which this deployment does not enable "
            f"(enabled: {deploy.plugins}). Fix: drop the options or ask the operator to enable {plugin!r}."
        )
    if plugin not in host.registries.options:
        raise ConfigError(f"plugin {plugin!r} takes no options; got {sorted(options)}. Fix: drop them.")
    schema = host.registries.options.get(plugin)
    try:
        return schema.model_validate(options)
    except ValidationError as exc:
        raise ConfigError(explain(exc, f"options for plugin {plugin!r}", schema.model_fields)) from None


def deploy_plugin_options(host: PluginHost, deploy: DeploymentCard) -> dict[str, BaseModel]:
    """Every plugin's options in ``deploy``, validated, by plugin name."""
    return {
        plugin: validate_plugin_options(host, deploy, plugin, raw)
        for plugin, raw in deploy.plugin_options.items()
    }
