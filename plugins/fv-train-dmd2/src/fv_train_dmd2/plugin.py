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
    from fv_train_dmd2.config import DMD2Options

    register(PLUGIN, DMD2Options)
