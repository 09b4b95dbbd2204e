"""fv-train-self-forcing's pluggy hooks: the ``self_forcing`` training method and its option schema."""

from __future__ import annotations

from collections.abc import Callable

from fv_core.extend import hookimpl

PLUGIN = "fv-train-self-forcing"


@hookimpl
def fv_register_methods(register: Callable[..., None]) -> None:
    register("self_forcing", "fv_train_self_forcing.method:SelfForcingMethod")


@hookimpl
def fv_register_options(register: Callable[..., None]) -> None:
    register(
        PLUGIN, "fv_train_self_forcing.config:SelfForcingOptions"
    )  # lazy: imported when a deploy or load reads it
