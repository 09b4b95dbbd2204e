"""fv models as NVIDIA Dynamo workers: Dynamo's frontend serves ``/v1/videos``, ``/v1/images`` and chat
for them, and each worker exports the model's deployment card and calibrated cost model for routing.

``fv_dynamo.plugin`` registers the ``fv dynamo-worker`` command. The names below are imported on first
use, so loading the plugin does not import Dynamo.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_MODULE = {
    "CostRouter": "router",
    "ROUTING_KEY": "export",
    "Handlers": "handlers",
    "cost_model": "export",
    "frontend_body": "router",
    "routing_card": "export",
    "serve_worker": "worker",
    "slug": "worker",
}
__all__ = sorted(_MODULE)


def __getattr__(name: str) -> Any:
    if name not in _MODULE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_MODULE[name]}"), name)
