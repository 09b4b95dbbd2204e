"""Python surface: load a Wan card on weights and generate, through fv_core's generic facade."""

from __future__ import annotations

from pathlib import Path

from fv_core import LoadedModel, ModelCard, UnknownKeyError, VideoArtifact, generate_video, load_model
from fv_wan.cards import CARDS


def card(card_id: str) -> ModelCard:
    """The fv-wan card ``card_id``; unknown ids list the available ones."""
    cards = {factory().model_id: factory for factory in CARDS}
    if card_id not in cards:
        raise UnknownKeyError(f"unknown model {card_id!r}. Available: {sorted(cards)}")
    return cards[card_id]().validate()


def load(card_id: str | ModelCard, weights: str | Path | None = None, device: str = "cpu") -> LoadedModel:
    """A card bound to a live ``WanModel`` (on the card's embedded weights when ``weights`` is omitted).
    Reuse it across calls: the text-embedding cache lives on it."""
    return load_model(
        card(card_id) if isinstance(card_id, str) else card_id, weights, device, plugin="fv-wan"
    )


def generate(
    model: str | LoadedModel,
    weights: str | Path | None = None,
    *,
    prompt: str,
    negative_prompt: str = "",
    num_frames: int | None = None,
    height: int | None = None,
    width: int | None = None,
    steps: int | None = None,
    guidance: float | None = None,
    seed: int = 0,
    sampler: str | None = None,
    cfg_mode: str = "two_forward",
    progress=None,
) -> VideoArtifact:
    """One video: ``.frames`` [F, H, W, 3] in 0..1, ``.provenance``, ``.save("out.mp4")`` (+ ``out.json``).
    ``None`` parameters take the card's defaults; ``progress(step, total)`` is called per step."""
    loaded = load(model, weights) if isinstance(model, str) else model
    params = dict(
        prompt=prompt,
        negative_prompt=negative_prompt,
        num_frames=num_frames,
        height=height,
        width=width,
        steps=steps,
        guidance=guidance,
        sampler=sampler,
        cfg_mode=cfg_mode,
    )
    params = {k: v for k, v in params.items() if v is not None}
    return generate_video(loaded, params, seed=seed, progress=progress)
