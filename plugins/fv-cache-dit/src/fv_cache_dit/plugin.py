"""fv-cache-dit plugin entry point: the ``fbcache``, ``dbcache`` and ``taylorseer`` block interceptors."""

from __future__ import annotations

from collections.abc import Callable

from fv_core.extend import hookimpl


@hookimpl
def fv_register_interceptors(register: Callable[..., None]) -> None:
    # lazy: imported on first use (they import torch); each class's name is its key, its kind "block_skip"
    for name, factory in (("fbcache", "FBCache"), ("dbcache", "DBCache"), ("taylorseer", "TaylorSeer")):
        register(name, f"fv_cache_dit.dbcache:{factory}")


@hookimpl
def fv_register_options(register: Callable[..., None]) -> None:
    register(
        "fv-cache-dit", "fv_cache_dit.options:CacheDiTOptions"
    )  # lazy: imported when a deploy or load reads it
