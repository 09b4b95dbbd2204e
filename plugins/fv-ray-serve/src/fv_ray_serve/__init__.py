"""fv fleet: Ray Serve deployments of fv engines behind the OpenAI-compatible API.

``fv_ray_serve.plugin`` registers the ``ray`` fleet that ``fv serve --ray`` runs. The names below are
imported on first use, so loading the plugin does not import Ray.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_MODULE = {
    "QUEUE_DEPTH": "autoscale",
    "QueueDepthPolicy": "autoscale",
    "Fleet": "config",
    "ModelFleet": "config",
    "load_fleet_file": "config",
    "split_fleet": "config",
    "FvReplica": "deployment",
    "app_builder": "deployment",
    "applications": "deployment",
    "run_fleet": "run",
}
__all__ = sorted(_MODULE)


def __getattr__(name: str) -> Any:
    if name not in _MODULE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_MODULE[name]}"), name)
