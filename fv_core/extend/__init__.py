"""Extension seam: observers (read-only) and interceptors (compute-altering)."""

from fv_core.extend.protocols import (
    BaseObserver,
    BlockInterceptor,
    KVPolicy,
    Observer,
    SpanInterceptor,
    StepInterceptor,
    plugin_slot,
)
from fv_core.hookspecs import hookimpl
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
