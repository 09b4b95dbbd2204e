"""Extension seam: observers (read-only) and interceptors (compute-altering).

``hookimpl`` is imported eagerly (every plugin module imports it); the rest on first use, so discovering
plugins does not import torch."""

import importlib
from typing import TYPE_CHECKING, Any

from fv_core.hookspecs import hookimpl

if TYPE_CHECKING:
    from fv_core.extend.protocols import (
        BaseObserver,
        BlockInterceptor,
        KVPolicy,
        Observer,
        SpanInterceptor,
        StepInterceptor,
        plugin_slot,
    )
    from fv_core.loop.seam import (
        BLOCK_SKIP,
        BLOCKS_INPUT,
        KV_INPUT,
        KV_POLICY,
        STEP_SKIP,
        BlockFn,
        BlockHook,
        check_interceptors,
        drive_blocks,
        negotiate,
    )
    from fv_core.loop.spans import BlockHooks, drive_spans

_HOMES = {
    **dict.fromkeys(
        [
            "BaseObserver",
            "BlockInterceptor",
            "KVPolicy",
            "Observer",
            "SpanInterceptor",
            "StepInterceptor",
            "plugin_slot",
        ],
        "fv_core.extend.protocols",
    ),
    **dict.fromkeys(["BlockHooks", "drive_spans"], "fv_core.loop.spans"),
}


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'fv_core.extend' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES.get(name, "fv_core.loop.seam")), name)
    globals()[name] = value
    return value


__all__ = [
    "hookimpl",
    "BLOCKS_INPUT",
    "BLOCK_SKIP",
    "KV_INPUT",
    "KV_POLICY",
    "STEP_SKIP",
    "BaseObserver",
    "BlockFn",
    "BlockHook",
    "BlockHooks",
    "BlockInterceptor",
    "KVPolicy",
    "Observer",
    "SpanInterceptor",
    "StepInterceptor",
    "check_interceptors",
    "negotiate",
    "plugin_slot",
    "drive_blocks",
    "drive_spans",
]
