"""The core's own contributions, registered like any plugin's (as ``fv-core``)."""

from __future__ import annotations

from fv_core.hookspecs import Register, hookimpl


@hookimpl
def fv_register_kernels(register: Register) -> None:
    register(("attention", "any", "any", "sdpa"), "fv_core.kernels:sdpa_attention")
