"""Shared constants and helpers for the fv-wan tests."""

from __future__ import annotations

from pathlib import Path

import torch

from fv_core import LoadedModel
from fv_core.request import Request
from fv_core.runtime import Engine
from fv_wan.cards import wan_tiny
from fv_wan.folder import WanFolder
from fv_wan.model import WanModel
from fv_wan.t2v_loop import WanLoop

PROMPT = "a cat running in the forest"
NEGATIVE = "blurry low quality"
BASE = dict(
    prompt=PROMPT,
    negative_prompt=NEGATIVE,
    num_frames=5,
    height=32,
    width=48,
    num_inference_steps=3,
    guidance_scale=5.0,
    max_sequence_length=512,
)


def tiny_instance(path: str, card=None) -> WanModel:
    """A WanModel of ``card`` (default: the tiny card) bound to the folder, as ``fv_core.load`` binds it."""
    return WanModel(WanFolder.bind(card or wan_tiny(), Path(path)), path)


def front(model: WanModel) -> LoadedModel:
    """The front door of a bare instance (what ``fv_core.load`` returns, without a plugin host)."""
    return LoadedModel(model.card, model, str(model.weights), source=model.card.model_id)


def request(model: WanModel, rid: str = "r", seed: int = 0, task: str = "t2v", **params) -> Request:
    """A typed request for ``model``: BASE overridden by ``params``, the rest the card's defaults."""
    return front(model).prepare({**BASE, "seed": seed, **params}, task=task, request_id=rid)


def run(model: WanModel, seed: int = 0, task: str = "t2v", **params):
    """One request through fv's Engine; returns the LoopResult."""
    with torch.no_grad():
        return Engine().run_one(WanLoop(model), request(model, seed=seed, task=task, **params), model)
