"""fv-sta plugin entry point: the STA attention kernels and their options schema."""

from __future__ import annotations

from collections.abc import Callable

from fv_core.extend import hookimpl

PLUGIN = "fv-sta"


@hookimpl
def fv_register_kernels(register: Callable[..., None]) -> None:
    register(("attention", "any", "any", "sta"), "fv_sta.kernel:sta_flex")
    register(("attention", "cpu", "any", "sta"), "fv_sta.kernel:sta_gather")
    register(("attention", "cuda", "sm90", "sta"), "fv_sta.kernel:sta_hopper")


@hookimpl
def fv_register_options(register: Callable[..., None]) -> None:
    register(PLUGIN, "fv_sta.options:StaOptions")  # lazy: imported when a deploy or load reads it
