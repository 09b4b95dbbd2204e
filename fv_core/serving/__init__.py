"""HTTP serving: an OpenAI-compatible FastAPI app over the asyncio engine, with a durable job store.

Needs the `serve` extra (`pip install fv-core[serve]`); the names below import FastAPI on first use, so
``fv`` runs without it. A fleet plugin (fv-ray-serve) runs ``create_app`` in each replica, with the
fleet's ``SessionDirectory`` (a ``LocalDirectory`` shared by them all: where each session lives).
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_MODULE = {
    "create_app": "app",
    "default_data_dir": "jobs",
    "LocalDirectory": "placement",
    "SessionDirectory": "placement",
}
__all__ = sorted(_MODULE)


def __getattr__(name: str) -> Any:
    if name not in _MODULE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_MODULE[name]}"), name)
