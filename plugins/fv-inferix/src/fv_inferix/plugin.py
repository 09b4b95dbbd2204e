"""fv-inferix plugin entry point: the ``inferix`` KV policy interceptor and its options schema."""

from __future__ import annotations

from collections.abc import Callable

from fv_core.extend import hookimpl


@hookimpl
def fv_register_interceptors(register: Callable[..., None]) -> None:
    from fv_inferix.policy import Inferix

    register(Inferix.name, Inferix)  # kind = "kv_policy": cards with a block-causal loop accept it


@hookimpl
def fv_register_options(register: Callable[..., None]) -> None:
    from fv_inferix.options import PLUGIN, InferixOptions

    register(PLUGIN, InferixOptions)
