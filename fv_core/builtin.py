"""The core's own contributions, registered like any plugin's (as ``fv-core``)."""

from __future__ import annotations

import importlib.util

from fv_core.hookspecs import Register, hookimpl


@hookimpl
def fv_register_kernels(register: Register) -> None:
    register(("attention", "any", "any", "sdpa"), "fv_core.kernels:sdpa_attention")
    for variant in ("segments", "sdpa", "flex", "padded"):
        register(("packed_attention", "any", "any", variant), f"fv_core.kernels_packed:packed_{variant}")
    if importlib.util.find_spec("flash_attn") is not None:  # found, not imported: no torch at registration
        register(("packed_attention", "cuda", "any", "varlen"), "fv_core.kernels_packed:packed_varlen")
