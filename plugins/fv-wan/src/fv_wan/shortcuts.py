"""Python shortcuts over ``fv_core.load``: the same recipe the CLI and the server use."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import fv_core
from fv_core import LoadedModel
from fv_core.card import ModelCard, complete_card
from fv_wan import cards


def card(card_id: str) -> ModelCard:
    """The fv-wan card ``card_id`` with its default kernels, validated (unknown ids list the others)."""
    return complete_card(cards.card(card_id))


def load(model: str | Path, weights: str | Path | None = None, **kw: Any) -> LoadedModel:
    """``fv_core.load(model, weights, **kw)``: reuse the result, its text caches live on it."""
    return fv_core.load(model, weights, **kw)


def generate(model: str | LoadedModel, weights: str | Path | None = None, **params: Any) -> Any:
    """One artifact: ``generate("wan2.1-t2v-shapes", prompt="a red circle moving left", seed=1)``.
    Omitted params take the card's defaults; see ``LoadedModel.generate``."""
    loaded = load(model, weights) if not isinstance(model, LoadedModel) else model
    return loaded.generate(**params)
