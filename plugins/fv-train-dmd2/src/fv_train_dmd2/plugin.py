"""fv-train-dmd2's pluggy hooks: the ``dmd2`` training method and its option schema."""

from __future__ import annotations

from collections.abc import Callable

from fv_core.extend import hookimpl

PLUGIN = "fv-train-dmd2"


@hookimpl
def fv_register_methods(register: Callable[..., None]) -> None:
    register("dmd2", "fv_train_dmd2.method:DMD2Method")


@hookimpl
def fv_register_options(register: Callable[..., None]) -> None:
    register(PLUGIN, "fv_train_dmd2.config:DMD2Options")  # lazy: it builds on fv_core.training (torch)
