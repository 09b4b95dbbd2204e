"""Workflows that plugins register (``fv_register_workflows``): their stages name card ids, and a deploy
file serves one with ``workflows: {ID: registered-id}``, each stage on the served model of its card. A
registered workflow also loads alone (``fv_core.load(workflow_id)``): a deploy of just the cards it names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fv_core.errors import ConfigError
from fv_core.workflow.spec import WorkflowSpec

if TYPE_CHECKING:
    from fv_core.deploy.card import DeploymentCard
    from fv_core.plugins import PluginHost


def registered_workflow(host: PluginHost, name: str) -> WorkflowSpec:
    """The workflow a plugin registered as ``name`` (UnknownKeyError listing them when none did)."""
    value = host.registries.workflows.get(name)
    value = value() if callable(value) and not isinstance(value, type) else value
    return value if isinstance(value, WorkflowSpec) else WorkflowSpec.model_validate(value)


def deploy_workflows(deploy: DeploymentCard, host: PluginHost) -> dict[str, WorkflowSpec]:
    """The deploy file's workflows by id, a registered one's stages moved onto the served models."""
    return {
        workflow_id: entry
        if isinstance(entry, WorkflowSpec)
        else _on_served_models(deploy, workflow_id, entry, registered_workflow(host, entry))
        for workflow_id, entry in deploy.workflows.items()
    }


def _on_served_models(
    deploy: DeploymentCard, workflow_id: str, name: str, spec: WorkflowSpec
) -> WorkflowSpec:
    served = {m.served_name for m in deploy.models} | set(deploy.workflows)
    by_card: dict[str, str] = {}
    for entry in deploy.models:
        by_card.setdefault(entry.card, entry.served_name)
    stages = []
    for stage in spec.stages:
        model = stage.model
        if model not in served:
            if model not in by_card:
                raise ConfigError(
                    f"workflows.{workflow_id}: the registered workflow {name!r} runs the card {model!r} in its "
                    f"stage {stage.name!r}, and no model of this deploy file runs it. "
                    f"Fix: add {{card: {model}}} to models."
                )
            model = by_card[model]
        stages.append(stage.model_copy(update={"model": model}))
    return spec.model_copy(update={"stages": stages})


def workflow_deploy(host: PluginHost, workflow_id: str) -> DeploymentCard:
    """A deploy file serving the registered workflow ``workflow_id`` alone: every card it names (each
    served under its card id), the plugins that provide them, its scorers and the workflow itself."""
    from fv_core.deploy.card import parse_deploy
    from fv_core.plugins import BUILTIN_PLUGIN

    spec = registered_workflow(host, workflow_id)
    cards = list(dict.fromkeys(stage.model for stage in spec.stages))
    plugins = {host.registries.workflows.plugin_of(workflow_id)}
    plugins |= {host.registries.cards.plugin_of(card) for card in cards if card in host.registries.cards}
    plugins |= {
        host.registries.scorers.plugin_of(s.scorer.scorer)
        for s in spec.stages
        if s.scorer is not None and s.scorer.scorer in host.registries.scorers
    }
    return parse_deploy(
        {
            "plugins": sorted(plugins - {BUILTIN_PLUGIN}),
            "models": [{"card": card, "name": card} for card in cards],
            "workflows": {workflow_id: workflow_id},
        }
    )
