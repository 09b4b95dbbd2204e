"""BAGEL's typed per-request state is one json-able dict in ``state.values["bagel"]``: ``save_state`` /
``load_state`` round-trip it mid-run, and the typed views read the same fields back."""

from __future__ import annotations

import json
from dataclasses import fields

import numpy as np
import torch

from fv_bagel.state import ChatState, DenoiseState
from fv_core.loop import StepResult, load_state, save_state
from fv_core.request import ImagePart

PICTURE = ImagePart(np.random.default_rng(2).random((40, 56, 3)).astype(np.float32))


def plain(view) -> dict:
    return json.loads(json.dumps({f.name: getattr(view, f.name) for f in fields(view)}))


def test_saved_state_reads_back_through_the_typed_views(bagel, tmp_path):
    for task, typed, params in [
        ("chat", ChatState, {"prompt": "what is this?", "max_tokens": 3}),
        ("edit", DenoiseState, {"prompt": "make it red", "num_inference_steps": 2}),
    ]:
        loop = bagel.loop(task)
        with torch.inference_mode():
            state = loop.init(bagel.prepare(params, task=task, parts=[PICTURE]))
            for _ in range(2):  # mid-prefill
                plan = loop.next(state)
                loop.advance(state, StepResult(outputs=plan.body(plan.inputs)))
        loaded = load_state(save_state(state, tmp_path / task))
        assert plain(typed.of(loaded)) == plain(typed.of(state))
        assert loaded.values["weights_versions"] == state.values["weights_versions"]
        loop.release(state)
    assert bagel.instance.kv_pool.drain() == 0
