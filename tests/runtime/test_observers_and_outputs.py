"""Observers enabled as interceptors see every step; non-finite outputs fail their request only."""

from __future__ import annotations

import pytest
import torch

from fv_core import NonFiniteOutput
from fv_core.extend import plugin_slot
from fv_core.request import Request
from fv_core.runtime import Engine
from tests.runtime.synthetic import DenoiseLoop


class StepCounter:
    """An observer a deploy enables by name: it rides on the request like an interceptor."""

    kind = "observer"
    plugin_id = "counter"

    def on_step(self, state, plan, result) -> None:
        slot = plugin_slot(state, self.plugin_id)
        slot["steps"] = slot.get("steps", 0) + 1

    def on_finish(self, state, result) -> None:
        result.metrics["seen"] = plugin_slot(state, self.plugin_id)["steps"]


def test_an_observer_enabled_as_an_interceptor_sees_every_step(model, denoise):
    events = []
    engine = Engine(on_event=events.append)
    counter = StepCounter()
    results = engine.run_interleaved(
        [
            (denoise, Request(f"r{i}", params={"steps": 3 + i}, seed=i, interceptors=(counter,)), model)
            for i in range(2)
        ]
    )
    for i, result in enumerate(results):
        progress = [e for e in events if e.request_id == f"r{i}" and e.kind == "progress"]
        assert result.metrics["seen"] == len(progress) == 3 + i


class NaNLoop(DenoiseLoop):
    """Denoises like its parent; the request ``bad`` ends with NaN latents (an overflowing scheduler)."""

    def finalize(self, state):
        result = super().finalize(state)
        if state.request_id == "bad":
            result.outputs["latents"] = result.outputs["latents"] * float("nan")
        return result


def test_non_finite_outputs_fail_that_request_and_no_other(model):
    loop = NaNLoop(model)
    with pytest.raises(NonFiniteOutput, match="'bad': output 'latents' holds NaN.*Fix"):
        Engine().run_one(loop, Request("bad", params={"steps": 2}), model)
    events = []
    engine = Engine(on_event=events.append)
    with pytest.raises(NonFiniteOutput):  # the engine reports the failed request ...
        engine.run_interleaved([(loop, Request(r, params={"steps": 2}), model) for r in ("bad", "good")])
    done = {e.request_id: e.data for e in events if e.kind in ("done", "error")}
    assert isinstance(done["bad"], NonFiniteOutput)  # ... and the other one finished, finite
    assert torch.isfinite(done["good"].outputs["latents"]).all()
    assert engine.admission.usage()["running"] == 0
