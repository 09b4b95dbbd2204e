"""Memory in the cost model: a call's peak bytes are measured (tensor allocations on CPU), calibrate the
plans' predicted peaks per row, and keep admission and batching under the budget (by default what the
device has); a batch that ran out of memory at N rows teaches a row limit below N; and a program's later
stages count in its remaining work."""

import math
from dataclasses import replace

import pytest
import torch

from fv_core.loop import LoopContext
from fv_core.program import Program, Stage
from fv_core.request import Request
from fv_core.runtime import Budget, CostModel, Engine, SchedulingPolicy
from fv_core.runtime.admission import resident_bytes
from fv_core.runtime.cost import curve_key
from fv_core.runtime.memory import device_memory_bytes, measure_peak
from tests.runtime.synthetic import DecodeLoop, DenoiseLoop
from tests.runtime.test_oom import OomDenoise, items

KEY = ("denoise", "diffusion_step", "bucket")


def test_measure_peak_counts_the_tensors_a_call_creates_until_they_are_freed():
    x = torch.ones(1000)  # live before: not counted
    with measure_peak("cpu") as peak:
        y = x * 2  # 4000 bytes
        z = y + 1  # 8000 at once
        del y
        z.add_(1)  # in place: nothing new
        w = z.view(10, 100)  # a view: nothing new
        u = torch.empty(500)  # 2000 more, 10000 held at the peak? no: y was freed, 6000
    assert peak.bytes == 8000
    assert w.shape == (10, 100) and u.numel() == 500


def test_peaks_are_calibrated_per_row_and_admission_keeps_the_batch_under_the_budget(model):
    loop = Rows(model)
    cost = CostModel()
    Engine(cost_model=cost).run_one(loop, Request("warm", params={"steps": 2}), model)
    [(key, curve)] = [(k, c) for k, c in cost.curves().items() if k[0] == "denoise"]
    assert curve.peak_row_bytes > 0 and 1 in curve.peak_rows  # measured on its first call, not declared
    state = loop.init(Request("p", params={"steps": 2}), model, LoopContext())
    plan = cost.fill(state, loop.next(state))
    assert curve_key(state, plan) == key and plan.peak_bytes == math.ceil(curve.peak_row_bytes)
    declared = 64 * 8 * 16 * 4  # the loop's estimate: admission reserves at least that per request
    budget = Budget(memory_bytes=resident_bytes(model) + 2.5 * max(declared, plan.peak_bytes))
    engine = Engine(budget, cost_model=cost, scheduling=SchedulingPolicy("fair"))
    loop.rows.clear()
    engine.run_batched([(loop, Request(f"r{i}", params={"steps": 3}, seed=i), model) for i in range(5)])
    assert max(loop.rows) == 2 and engine.admission.usage()["memory_bytes"] == 0  # two fit at once
    assert cost.row_limit(key, 2.5 * curve.peak_row_bytes) == 2  # batching's own cap, from the headroom


def test_the_default_memory_budget_is_what_the_device_has():
    total = device_memory_bytes("cpu")
    assert 0 < total < math.inf and Engine().admission.budget.memory_bytes == total
    assert Engine(Budget(memory_bytes=5000)).admission.budget.memory_bytes == 5000  # a set budget stays


def test_a_batch_that_ran_out_of_memory_at_n_rows_is_never_batched_at_n_rows_again(model):
    loop = OomDenoise(model, max_rows=2, alone=False, error=torch.OutOfMemoryError)  # 3 rows do not fit
    engine = Engine(scheduling=SchedulingPolicy("fair"))
    results = engine.run_batched(items(loop, model, poison_at=-1))
    # 4 rows ran out of memory (split, each alone); then at most 3: out of memory again; then pairs
    assert loop.calls == [4, 1, 1, 1, 1, 3, 1, 1, 1, 1, 2, 2]
    solo = Engine().run_serial(items(DenoiseLoop(model), model, poison_at=-1))
    for got, want in zip(results, solo, strict=True):  # batched mode: equal within the batched tolerance
        torch.testing.assert_close(got.outputs["latents"], want.outputs["latents"], atol=1e-5, rtol=0)
    [curve] = [c for k, c in engine.cost.curves().items() if k[0] == "denoise"]
    assert curve.oom_rows == 3 and engine.decisions.split == 2


def test_the_row_limit_lifts_when_a_call_of_that_many_rows_succeeds():
    cost = CostModel()
    cost.observe_oom(KEY, 4)
    assert cost.row_limit(KEY) == 3
    cost.observe_oom(KEY, 6)  # a larger failure teaches nothing new
    assert cost.row_limit(KEY) == 3
    cost.observe_call(KEY, 4, 1.0)  # evidence: 4 rows fit now (memory was freed elsewhere)
    assert cost.row_limit(KEY) == 4
    cost.observe_peak(KEY, 2, 1000)  # 500 bytes per row
    assert cost.row_limit(KEY, headroom_bytes=1600) == 3 and cost.row_limit(KEY, 100) == 1


def bind_tokens(request, results):
    return replace(request, params={**request.params, "tokens": results["decode"].outputs["tokens"]})


def test_remaining_work_counts_a_programs_later_stages(model, decode, denoise):
    """A chat-then-image program with 2 tokens to go and a 16-step image stage after them has more work
    left than a 6-token chat: once the image stage was measured, the chat leads."""
    program = Program("t2i_with_prompt_ar", [Stage("decode", decode), Stage("denoise", denoise, bind_tokens)])

    def first_step(engine):
        order = []
        engine.on_event = lambda e: e.kind == "progress" and order.append(e.request_id)
        params = {"max_tokens": 2, "steps": 16, "temperature": 0.0}
        chat = {"max_tokens": 6, "temperature": 0.0, "prompt": list(range(1, 12))}  # another batch key
        engine.run_batched(
            [(program, Request("image", params=params), model), (decode, Request("chat", params=chat), model)]
        )
        return order[0]

    engine = Engine(scheduling=SchedulingPolicy("auto", max_wait_factor=100.0))
    assert first_step(engine) == "image"  # its later stage not measured yet: 2 tokens < 6 tokens
    assert first_step(engine) == "chat"  # now priced: 2 tokens + 16 denoise steps > 6 tokens
    learned = engine.cost.stages_s("t2i_with_prompt_ar", ["denoise"], model)
    assert learned > engine.cost.stages_s("t2i_with_prompt_ar", ["decode"], model) > 0


class Rows(DenoiseLoop):
    """The denoise loop, recording the rows of each body call."""

    def __init__(self, model) -> None:
        super().__init__(model)
        self.rows: list[int] = []

    def denoise_body(self, inputs):
        self.rows.append(inputs["x"].shape[0])
        return super().denoise_body(inputs)


class OpenDecode(DecodeLoop):
    """AR decoding whose step count is not known in advance (as BAGEL's chat: ``total_steps`` is None)."""

    def init(self, request, instance, ctx):
        state = super().init(request, instance, ctx)
        state.values["cap"], state.total_steps = state.total_steps, None
        return state

    def next(self, state):
        state.total_steps = state.values["cap"]
        try:
            return super().next(state)
        finally:
            state.total_steps = None


def test_open_ended_loops_are_priced_at_the_steps_such_loops_took_before(model):
    """Not at the open-loop cap (256 steps), which would rank a short chat behind every video."""
    loop, engine = OpenDecode(model), Engine(scheduling=SchedulingPolicy("auto"))
    params = {"max_tokens": 4, "temperature": 0.0}
    capped = engine.scheduler(batching=False).submit(loop, Request("a", params=params), model).need
    assert engine.cost.open_steps("decode", model, 256) == 256
    engine.run_one(loop, Request("b", params=params), model)
    assert engine.cost.open_steps("decode", model, 256) == 4
    learned = engine.scheduler(batching=False).submit(loop, Request("c", params=params), model).need
    ratio = engine.cost.ratio(("decode", "ar_token", f"synthetic-{id(model)}"))
    assert (
        learned.compute_s == pytest.approx(4 * loop.step_cost_s * ratio)
        and capped.compute_s == 256 * loop.step_cost_s
    )
