"""fv-sta registration, options validation and kernel selection with reported fallback."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

import fv_sta.plugin
from fv_core import UnknownKeyError
from fv_core.kernels_select import select_kernel
from fv_core.plugins import PluginHost
from fv_sta.kernel import StaFlex, StaGather, StaHopper
from fv_sta.options import StaOptions, StaWindow


@pytest.fixture
def host() -> PluginHost:
    host = PluginHost(env={})
    host.add(fv_sta.plugin, "fv-sta")
    return host.collect()


def test_registers_kernels_and_options(host):
    kernels = host.registries.kernels
    assert kernels.plugin_of(("attention", "any", "any", "sta")) == "fv-sta"
    assert isinstance(kernels.get(("attention", "any", "any", "sta")), StaFlex)
    assert isinstance(kernels.get(("attention", "cpu", "any", "sta")), StaGather)
    assert isinstance(kernels.get(("attention", "cuda", "sm90", "sta")), StaHopper)
    assert host.registries.options.get("fv-sta") is StaOptions


def test_select_on_cpu_binds_options_and_records_provenance(host):
    options = StaOptions(compile=False, windows=[StaWindow(grid=(4, 8, 8), tile=(2, 4, 4), window=(1, 1, 1))])
    impl, record = select_kernel(host.registries, "attention", "sta", "cpu", options=options)
    assert isinstance(impl, StaGather) and impl.options is options
    assert record["key"] == ["attention", "cpu", "any", "sta"] and record["plugin"] == "fv-sta"
    assert record["fallback_reason"] is None
    assert impl.geometry((4, 8, 8)).window == (1, 1, 1)


def test_unknown_variant_is_an_error_or_a_reported_fallback(host):
    with pytest.raises(UnknownKeyError, match="sta"):
        select_kernel(host.registries, "attention", "flash3", "cpu")
    impl, record = select_kernel(host.registries, "attention", "flash3", "cpu", fallback="sdpa")
    assert record["variant"] == "sdpa" and "'flash3' unavailable" in record["fallback_reason"]


def test_hopper_kernel_reports_why_it_falls_back_to_flex():
    q = torch.randn(1, 2, 4 * 8 * 8, 16)
    geometry = StaFlex().geometry((4, 8, 8), tile=(2, 4, 4), window=(1, 1, 1))
    path = StaHopper().path(q, geometry).record()
    assert path["path"] == "flex" and path["fallback_reason"]
    assert path["window"] == (1, 1, 1)
    eager = StaOptions(compile=False)  # the fallback runs flex: here, on CPU, eagerly
    q, k, v = torch.randn(3, 1, 2, 4 * 8 * 8, 16)
    call = {"grid": (4, 8, 8), "tile": (2, 4, 4), "window": (1, 1, 1)}
    fell_back = StaHopper().with_options(eager)(q, k, v, **call)
    assert torch.equal(fell_back, StaFlex(eager)(q, k, v, **call))


def test_options_pick_card_and_grid_then_defaults():
    options = StaOptions(
        windows=[
            StaWindow(grid=(8, 16, 16), window=(1, 1, 1)),
            StaWindow(card="wan-a", grid=(8, 16, 16), window=(2, 2, 2)),
        ]
    )
    assert options.window_for("wan-a", (8, 16, 16)).window == (2, 2, 2)
    assert options.window_for("wan-b", (8, 16, 16)).window == (1, 1, 1)
    fallback = options.window_for("wan-b", (4, 16, 24))  # default tile (4, 8, 8): 1 x 2 x 3 tiles
    assert fallback.window == (1, 2, 3)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"grid": (4, 16, 16), "window": (2, 1, 1)}, "exceeds the grid"),
        ({"tile": (2, 4, 4), "block_size": 24}, "must divide the tile volume"),
        ({"window": (3, 3)}, "tuple"),
    ],
)
def test_bad_windows_are_rejected(entry, message):
    with pytest.raises(ValidationError, match=message):
        StaOptions.model_validate({"windows": [entry]})
