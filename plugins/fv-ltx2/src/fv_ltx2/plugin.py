"""fv-ltx2's pluggy hooks (entry point ``fv.plugins: fv-ltx2``). Everything is lazy: no model code is
imported until a card is loaded."""

from __future__ import annotations

from fv_core import hookimpl

CARDS = {
    "ltx2-tiny": "fv_ltx2.cards:ltx2_tiny",
    "ltx-2": "fv_ltx2.cards:ltx2_dev",
    "ltx-2-distilled": "fv_ltx2.cards:ltx2_distilled",
}


@hookimpl
def fv_register_cards(register) -> None:
    for model_id, factory in CARDS.items():
        register(model_id, factory)


@hookimpl
def fv_register_loops(register) -> None:
    for name, loop in (("t2av", "LTX2Loop"), ("upsample", "LTX2UpsampleLoop"), ("refine", "LTX2RefineLoop"),
                       ("i2av", "LTX2ImageLoop")):  # fmt: skip
        register(f"ltx2.{name}", f"fv_ltx2.loop:{loop}")


@hookimpl
def fv_register_pipelines(register) -> None:
    register("LTX2Pipeline", "fv_ltx2.folder:LTX2Folder")
