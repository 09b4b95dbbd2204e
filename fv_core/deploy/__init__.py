"""Deployment cards: which cards and plugins a deployment enables."""

from fv_core.deploy.card import DeploymentCard, Limits, ModelDeploy, load_deploy, parse_deploy
from fv_core.deploy.check import check_deploy, deploy_plugin_options, validate_plugin_options

__all__ = [
    "DeploymentCard",
    "Limits",
    "ModelDeploy",
    "check_deploy",
    "deploy_plugin_options",
    "load_deploy",
    "parse_deploy",
    "validate_plugin_options",
]
