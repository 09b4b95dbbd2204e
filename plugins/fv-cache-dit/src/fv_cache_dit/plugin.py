"""fv-cache-dit plugin entry point: the ``fbcache``, ``dbcache`` and ``taylorseer`` block interceptors."""

from __future__ import annotations

from collections.abc import Callable

from fv_core.extend import hookimpl


@hookimpl
def fv_register_interceptors(register: Callable[..., None]) -> None:
    from fv_cache_dit.dbcache import DBCache, FBCache, TaylorSeer

    for factory in (FBCache, DBCache, TaylorSeer):
        register(factory.name, factory)  # each class carries kind = "block_skip"


@hookimpl
def fv_register_options(register: Callable[..., None]) -> None:
    from fv_cache_dit.options import PLUGIN, CacheDiTOptions

    register(PLUGIN, CacheDiTOptions)
