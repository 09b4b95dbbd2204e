"""Admission, refunds, queue limits, cancellation, streaming, batching, fairness, calibration."""

import pytest
import torch

from fv_core.card.spec import StepCostModel
from fv_core.errors import AdmissionInfeasible, Cancelled, QueueFull
from fv_core.loop import LoopContext
from fv_core.request import Request
from fv_core.runtime import AdmissionController, Budget, CostModel, Engine, Scheduler, SchedulerConfig
from fv_core.runtime.admission import resident_bytes
from tests.runtime.synthetic import DenoiseLoop, NullLoop

ZERO = {"compute_s": 0.0, "memory_bytes": 0, "running": 0}


def test_infeasible_compute_fails_fast_with_numbers(model, denoise):
    engine = Engine(Budget(compute_s=0.01))
    with pytest.raises(
        AdmissionInfeasible, match=r"compute needs 0\.020 s predicted but the budget is 0\.010 s"
    ):
        engine.run_one(denoise, Request("big", params={"steps": 20}), model)
    assert engine.admission.usage() == ZERO


def test_infeasible_memory_names_resident_and_peak(model, denoise):
    weights = resident_bytes(model)
    engine = Engine(Budget(memory_bytes=weights + 1000))
    with pytest.raises(AdmissionInfeasible, match=rf"memory needs {weights} resident \+ 32768 peak"):
        engine.run_one(denoise, Request("big"), model)


def test_budget_is_reserved_consumed_and_refunded(model, denoise, decode):
    engine = Engine(Budget(compute_s=1.0, memory_bytes=1 << 30))
    seen = []
    engine.on_event = lambda e: seen.append(dict(engine.admission.usage()))
    engine.run_one(decode, Request("eos", params={"max_tokens": 50, "eos": 0, "temperature": 0.0}), model)
    assert seen[0]["compute_s"] == pytest.approx(
        50 * decode.step_cost_s - decode.step_cost_s
    )  # one step spent
    assert seen[0]["memory_bytes"] > resident_bytes(model) and seen[0]["running"] == 1
    assert engine.admission.usage() == ZERO  # early EOS or cap: the rest is refunded


def test_requests_wait_for_budget_then_run(model, denoise):
    engine = Engine(Budget(compute_s=0.005))  # 5 predicted steps of outstanding work at once
    usage = []
    engine.on_event = lambda e: usage.append((e.request_id, e.step, dict(engine.admission.usage())))
    items = [(denoise, Request(f"r{i}", params={"steps": 4}, seed=i), model) for i in range(3)]
    results = engine.run_interleaved(items)
    assert all(r is not None for r in results)
    assert max(u["compute_s"] for _, _, u in usage) <= 0.005 + 1e-12
    assert max(u["running"] for _, _, u in usage) == 2  # r1 joins once r0 has 1 step left, never all 3
    assert next(step for rid, step, _ in usage if rid == "r1") == 1 and usage[2][0] == "r0"
    assert engine.admission.usage() == ZERO


def test_queue_limit_says_busy_retry_after(model, denoise):
    admission = AdmissionController(Budget(compute_s=0.004, max_waiting=1))
    sched = Scheduler(LoopContext(), admission, CostModel())
    sched.submit(denoise, Request("a", params={"steps": 4}), model)
    sched.step()  # "a" admitted and runs a step
    sched.submit(denoise, Request("b", params={"steps": 4}), model)  # waits for budget
    with pytest.raises(
        QueueFull, match=r"busy: 1 requests waiting \(limit 1\); retry after 0\.00[0-9] s"
    ) as err:
        sched.submit(denoise, Request("c", params={"steps": 4}), model)
    assert err.value.retry_after_s == pytest.approx(0.003)


def test_cancel_mid_run_releases_everything(model, denoise):
    # No compute cap: calibration from measured step times must not make the test depend on machine speed.
    engine = Engine(Budget(memory_bytes=1 << 30))
    events = []

    def on_event(e):
        events.append((e.request_id, e.kind, e.step))
        if (e.request_id, e.kind, e.step) == ("victim", "progress", 2):
            engine.cancel("victim")

    engine.on_event = on_event
    items = [
        (denoise, Request(r, params={"steps": 6}, seed=i), model) for i, r in enumerate(["victim", "other"])
    ]
    results = engine.run_interleaved(items)
    assert results[0] is None and results[1] is not None
    victim = [e for e in events if e[0] == "victim"]
    assert victim[-1] == ("victim", "cancelled", 2) and len(victim) == 3  # no step after the boundary
    assert engine.admission.usage() == ZERO
    with pytest.raises(Cancelled, match="'solo' was cancelled"):
        engine.cancel("solo")
        engine.run_one(denoise, Request("solo"), model)


def test_stream_order_is_per_step_then_done(model, denoise):
    events = []
    engine = Engine(on_event=events.append)
    engine.run_interleaved(
        [(denoise, Request(f"r{i}", params={"steps": 3, "tiles": i}), model) for i in range(3)]
    )
    for i in range(3):
        mine = [e for e in events if e.request_id == f"r{i}"]
        progress = [e for e in mine if e.kind == "progress"]
        assert [e.step for e in progress] == list(range(1, 4 + i)) and all(e.total == 3 + i for e in progress)
        assert len([e for e in mine if e.kind == "partial"]) == i and mine[-1].kind == "done"


def test_batched_steps_share_one_call_and_split_back(model, denoise, decode):
    sizes = []

    class Probe:
        plugin_id = "probe"

        def before(self, state, plan):
            return None

        def after(self, state, plan, result):
            sizes.append(result.batched_with)
            return result

    engine = Engine(interceptors=[Probe()], max_batch_rows=4)
    items = [(denoise, Request(f"d{i}", params={"steps": 2}, seed=i), model) for i in range(6)]
    items.append((decode, Request("a", params={"max_tokens": 2}), model))
    results = engine.run_batched(items)
    assert sorted(set(sizes)) == [1, 2, 4] and sizes.count(4) == 8 and sizes.count(2) == 4
    serial = Engine().run_serial(items)
    assert all(
        torch.allclose(a.outputs["latents"], b.outputs["latents"], atol=1e-5)
        for a, b in zip(results[:6], serial[:6], strict=True)
    )


def test_running_first_and_no_starvation_across_batch_keys(model, denoise):
    engine = Engine(max_units_per_tick=2)
    order = []
    engine.on_event = lambda e: e.kind == "progress" and order.append(e.request_id)
    items = [(NullLoop(), Request(f"n{i}", params={"steps": 3}), None) for i in range(3)]
    items.append((denoise, Request("d", params={"steps": 3}), model))
    engine.run_batched(items)
    first_round = order[:4]
    assert sorted(first_round) == ["d", "n0", "n1", "n2"]  # everyone served before anyone twice
    assert order == first_round * 3


def test_calibration_converges_to_measured_step_time(model):
    loop = DenoiseLoop(model, step_cost_s=1e-4, sleep_s=0.004)  # predicted 0.1 ms, real ~4+ ms
    engine = Engine()
    engine.run_one(loop, Request("warm", params={"steps": 8}), model)
    predicted = []
    engine.on_event = lambda e: predicted.append(engine.cost.ratio(("denoise", "diffusion_step", key)) * 1e-4)
    key = next(iter(engine.cost.calibrations()))[2]
    engine.run_one(loop, Request("r", params={"steps": 8}), model)
    measured = engine.profiler.seconds / engine.profiler.steps
    assert predicted[-1] > 0.004 and 0.5 * measured < predicted[-1] < 2 * measured  # from 40x off to ~1x


def test_step_cost_model_prices_plans_without_cost(model):
    cost = CostModel()
    cost.register("null", StepCostModel(base_s=0.5, per_token_s=0.0))
    sched = Scheduler(LoopContext(), AdmissionController(Budget(compute_s=10.0)), cost, SchedulerConfig())
    entry = sched.submit(NullLoop(), Request("n", params={"steps": 4}), None)
    assert entry.pending.cost_s == 1e-6 and entry.need.compute_s == pytest.approx(4e-6)


def test_ragged_inputs_are_padded_to_the_longest_before_concatenation():
    from fv_core.loop.contracts import WorkPlan, WorkUnitKind
    from fv_core.runtime.batching import concat_inputs

    def plan(length: int) -> WorkPlan:
        inputs = {"k": torch.ones(1, 2, length), "valid": torch.ones(1, length, dtype=torch.bool)}
        return WorkPlan(
            kind=WorkUnitKind.AR_TOKEN, body=lambda x: x, inputs=inputs, ragged={"k": 2, "valid": 1}
        )

    merged = concat_inputs([plan(3), plan(5)])
    assert merged["k"].shape == (2, 2, 5) and merged["valid"].shape == (2, 5)
    assert merged["valid"].sum(1).tolist() == [3, 5] and merged["k"][0, :, 3:].abs().sum() == 0
    plain = plan(3)
    plain.ragged = {}
    with pytest.raises(RuntimeError):  # without ragged, lengths must agree
        concat_inputs([plain, plan(5)])
