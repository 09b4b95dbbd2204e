"""LTX-2 checkpoint folders (``model_index.json`` class ``LTX2Pipeline``): a card from the folder's own
configs, so ``fv_core.load("/models/LTX-2")`` works without naming a card."""

from __future__ import annotations

import json
from pathlib import Path

from fv_core import ModelCard, StepCostModel
from fv_ltx2.cards import BASE_RECIPE, CLASSES, ltx2_card


class LTX2Folder:
    """The ``LTX2Pipeline`` reader (``fv_register_pipelines``)."""

    @staticmethod
    def card(folder: Path) -> ModelCard:
        """A card for the LTX-2 in ``folder``: diffusers' LTX2Pipeline defaults, STG on block 28 (or its last
        block when it has fewer)."""
        dit = json.loads((folder / "transformer" / "config.json").read_text())
        blocks = dit["num_layers"]
        config = {**CLASSES, "transformer": {**CLASSES["transformer"], "num_layers": blocks}}
        return ltx2_card(
            f"ltx2:{folder.name}",
            f"LTX-2 checkpoint at {folder} ({blocks} blocks); card built from its configs.",
            BASE_RECIPE,
            StepCostModel(base_s=1e-3 * blocks, per_token_s=1e-6 * blocks),
            defaults={"spatio_temporal_guidance_blocks": [min(28, blocks - 1)]},
            config=config,
        )

    @staticmethod
    def bind(card: ModelCard, folder: Path) -> ModelCard:
        """Named LTX-2 cards take the folder as it is (its configs were checked against the card)."""
        return card
