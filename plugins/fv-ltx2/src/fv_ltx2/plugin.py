"""fv-ltx2's pluggy hooks (entry point ``fv.plugins: fv-ltx2``). Everything is lazy: no model code is
imported until a card is loaded."""

from __future__ import annotations

from fv_core.extend import hookimpl

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
def fv_register_pipelines(register) -> None:
    register("LTX2Pipeline", "fv_ltx2.folder:LTX2Folder")
