"""fv plugin: DBCache / FBCache / TaylorSeer block interceptors with per-request state.

The names below are imported on first use, so loading the plugin does not import torch."""

from __future__ import annotations

from importlib import import_module
from typing import Any

_MODULE = {
    "DBCache": "dbcache",
    "FBCache": "dbcache",
    "TaylorSeer": "dbcache",
    "PLUGIN": "options",
    "CacheDiTOptions": "options",
    "summarize": "stats",
}
__all__ = sorted(_MODULE)


def __getattr__(name: str) -> Any:
    if name not in _MODULE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_MODULE[name]}"), name)
