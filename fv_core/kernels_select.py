"""Kernel choice for a device, with any fallback explicit and reported.

``select_kernel`` resolves a deploy/card kernel request (``op`` -> ``variant``)
against the kernels registry for the device the tensors live on, and returns
the implementation together with a provenance record naming what will run.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch
from pydantic import BaseModel

from fv_core.errors import UnknownKeyError
from fv_core.kernels import check_kernel
from fv_core.providers import provider_hint
from fv_core.registry import ANY, Registries, lookup_kernel


def device_arch(device: torch.device | str) -> tuple[str, str]:
    """``(device type, arch)``: ``("cuda", "sm90")`` on a Hopper GPU, ``(type, "any")`` elsewhere."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(device)
        return device.type, f"sm{major}{minor}"
    return device.type, ANY


def select_kernel(
    registries: Registries,
    op: str,
    variant: str,
    device: torch.device | str,
    options: BaseModel | Mapping[str, BaseModel] | None = None,
    fallback: str | None = None,
) -> tuple[Any, dict[str, Any]]:
    """The kernel for ``op``/``variant`` on ``device`` and its provenance record.

    ``options`` (the providing plugin's validated options, or validated options
    by plugin name, of which the chosen kernel's plugin's are used) are bound
    when the kernel has ``with_options``. When no kernel fits and ``fallback`` names a
    variant, that one is used and the record says why; otherwise the lookup
    error (which lists the variants) propagates.
    """
    dev, arch = device_arch(device)
    reason = None
    try:
        key, impl = lookup_kernel(registries.kernels, op, dev, arch, variant)
    except UnknownKeyError as exc:
        if fallback is None or fallback == variant:
            raise UnknownKeyError(f"{exc.args[0]}{provider_hint(registries, 'kernels', variant)}") from None
        reason = f"{variant!r} unavailable: {exc}"
        key, impl = lookup_kernel(registries.kernels, op, dev, arch, fallback)
    check_kernel(key, impl)
    kernel_key = cast(tuple[str, str, str, str], key)
    plugin = registries.kernels.plugin_of(key)
    if isinstance(options, Mapping):
        options = options.get(plugin)
    if options is not None and hasattr(impl, "with_options"):
        impl = impl.with_options(options)
    record = {
        "op": op,
        "requested": variant,
        "variant": kernel_key[3],
        "key": list(kernel_key),
        "plugin": plugin,
        "device": dev,
        "arch": arch,
        "fallback_reason": reason,
    }
    return impl, record
