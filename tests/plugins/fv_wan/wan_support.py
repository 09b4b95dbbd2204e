"""Shared constants and helpers for the fv-wan tests."""

from __future__ import annotations

import torch

from fv_core.request.request import Request
from fv_core.runtime import Engine
from fv_wan.loop import WanLoop

PROMPT = "a cat running in the forest"
NEGATIVE = "blurry low quality"
BASE = dict(prompt=PROMPT, negative_prompt=NEGATIVE, num_frames=5, height=32, width=48, steps=3, guidance=5.0)


def request(rid: str = "r", seed: int = 0, task: str = "text_to_video", **params) -> Request:
    return Request(request_id=rid, task=task, params={**BASE, **params}, seed=seed)


def run(model, seed: int = 0, task: str = "text_to_video", **params):
    """One request through fv's Engine; returns the LoopResult."""
    with torch.no_grad():
        return Engine().run_one(WanLoop(), request(seed=seed, task=task, **params), model)
