"""fv-bagel's pluggy hooks (entry point ``fv.plugins: fv-bagel``). Everything is lazy: no model code is
imported until a card is loaded."""

from __future__ import annotations

from fv_core.extend import hookimpl

CARDS = {
    "bagel-tiny": "fv_bagel.cards:bagel_tiny",
    "bagel-7b-mot": "fv_bagel.cards:bagel_7b_mot",
}


@hookimpl
def fv_register_cards(register) -> None:
    for model_id, factory in CARDS.items():
        register(model_id, factory)


@hookimpl
def fv_register_pipelines(register) -> None:
    register("Bagel", "fv_bagel.folder:BagelFolder")  # a folder in the published layout (no model_index.json)
