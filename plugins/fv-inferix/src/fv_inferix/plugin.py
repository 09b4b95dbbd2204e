"""fv-inferix plugin entry point: the ``inferix`` KV policy interceptor and its options schema."""

from __future__ import annotations

from collections.abc import Callable

from fv_core.extend import hookimpl


@hookimpl
def fv_register_interceptors(register: Callable[..., None]) -> None:
    # lazy: imported on first use (it imports torch); kind = "kv_policy": block-causal loops accept it
    register("inferix", "fv_inferix.policy:Inferix")  # the key is Inferix.name


@hookimpl
def fv_register_options(register: Callable[..., None]) -> None:
    register(
        "fv-inferix", "fv_inferix.options:InferixOptions"
    )  # lazy: imported when a deploy or load reads it
