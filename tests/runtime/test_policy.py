"""Scheduling policies: the auto decision rule on a synthetic cost model, the aging bound, fifo order, and
outputs that do not change with the policy (interleave gate, batched parity)."""

import pytest
import torch

from fv_core.errors import ConfigError
from fv_core.loop import BatchKey, Done, LoopContext, LoopResult, LoopState, WorkPlan, WorkUnitKind
from fv_core.parity.gate import assert_interleave_parity, check_batched_parity
from fv_core.request import Request
from fv_core.runtime import AdmissionController, Budget, CostModel, Engine, Scheduler, SchedulerConfig
from fv_core.runtime.policy import Candidate, SchedulingPolicy, pick_auto

KEY = ("denoise", "diffusion_step", BatchKey("m", "denoise", ((8, 16),), "float32"))
AUTO = SchedulingPolicy("auto", max_wait_factor=3.0)


def cand(name, remaining, key=KEY, due=float("inf"), seq=0, step=1.0):
    return Candidate(name, key, 1, step, remaining, due, seq)


def curve(points):
    cost = CostModel()
    for rows, seconds in points.items():
        cost.observe_call(KEY, rows, seconds)
    return cost


def test_auto_batches_where_the_batch_curve_says_a_call_costs_less_than_its_rows_apart():
    cands = [cand("a", 5.0, seq=0), cand("b", 2.0, seq=1), cand("c", 9.0, seq=2), cand("d", 3.0, seq=3)]
    cheap = curve({1: 1.0, 2: 1.1, 4: 1.3})  # a batched call costs about one row: batching pays
    call, why = pick_auto(cands, cheap, AUTO, 0.0, None, max_rows=8)
    assert why == "batch" and [c.entry for c in call] == ["b", "d", "a", "c"]  # least remaining leads
    call, _ = pick_auto(cands, cheap, AUTO, 0.0, None, max_rows=3)
    assert [c.entry for c in call] == ["b", "d", "a"]  # at most max_rows rows


def test_auto_runs_the_least_remaining_alone_where_batching_does_not_pay():
    cands = [cand("a", 5.0, seq=0), cand("b", 2.0, seq=1), cand("c", 9.0, seq=2)]
    linear = curve({1: 1.0, 2: 1.95, 3: 2.9})  # a row more costs about a row: 2.5 % saved < 10 % margin
    call, why = pick_auto(cands, linear, AUTO, 0.0, None, max_rows=8)
    assert why == "alone" and [c.entry for c in call] == ["b"]
    loose = SchedulingPolicy("auto", margin=0.0)
    call, why = pick_auto(cands, linear, loose, 0.0, None, max_rows=8)
    assert why == "batch" and len(call) == 3  # without a margin the 2.5 % pays


def test_auto_probes_an_unmeasured_curve_with_two_rows_then_again_after_probe_every_calls_alone():
    cands = [cand("a", 5.0, seq=0), cand("b", 2.0, seq=1), cand("c", 9.0, seq=2)]
    cost = curve({1: 1.0})
    call, why = pick_auto(cands, cost, AUTO, 0.0, None, max_rows=8)
    assert why == "probe" and [c.entry for c in call] == ["b", "a"]
    cost.observe_call(KEY, 2, 2.0)  # the probe measured: no sharing
    policy = SchedulingPolicy("auto", probe_every=3)
    assert pick_auto(cands, cost, policy, 0.0, None, max_rows=8)[1] == "alone"
    for _ in range(3):
        cost.observe_call(KEY, 1, 1.0)
    assert pick_auto(cands, cost, policy, 0.0, None, max_rows=8)[1] == "probe"


def test_auto_never_batches_across_keys_or_past_the_row_limit():
    other = ("denoise", "diffusion_step", BatchKey("m", "denoise", ((4, 16),), "float32"))
    cands = [cand("a", 1.0, seq=0), cand("b", 2.0, key=other, seq=1), cand("c", 3.0, key=None, seq=2)]
    assert pick_auto(cands, curve({1: 1.0, 2: 1.0}), AUTO, 0.0, None, max_rows=8) == ([cands[0]], "alone")
    assert pick_auto(cands[:1] * 1 + [cand("d", 2.0, seq=3)], curve({}), AUTO, 0.0, None, 1)[1] == "alone"


def test_a_late_request_leads_earliest_deadline_first_and_ties_keep_the_last_lead():
    cands = [
        cand("short", 1.0, seq=0),
        cand("long", 50.0, due=10.0, seq=1),
        cand("older", 40.0, due=8.0, seq=2),
    ]
    linear = curve({1: 1.0, 2: 2.0})
    assert pick_auto(cands, linear, AUTO, 5.0, None, 8)[0][0].entry == "short"  # nobody late yet: SRPT
    assert pick_auto(cands, linear, AUTO, 9.0, None, 8)[0][0].entry == "older"  # late: leads
    assert pick_auto(cands, linear, AUTO, 10.0, None, 8)[0][0].entry == "older"  # earliest deadline first
    tied = [cand("x", 2.0, seq=0), cand("y", 2.0, seq=1)]
    assert pick_auto(tied, linear, AUTO, 0.0, None, 8)[0][0].entry == "x"
    assert pick_auto(tied, linear, AUTO, 0.0, "y", 8)[0][0].entry == "y"  # no preemption that gains nothing


def test_policy_settings_are_checked():
    with pytest.raises(
        ConfigError, match=r"policy 'lifo' is unknown. Fix: use one of \['auto', 'fifo', 'fair'\]"
    ):
        SchedulingPolicy("lifo")
    with pytest.raises(ConfigError, match=r"max_wait_factor=0.5 is below 1"):
        SchedulingPolicy("auto", max_wait_factor=0.5)
    due = SchedulingPolicy("auto", max_wait_factor=2.0, ttfs_target_s=1.0).due
    assert due(3.0, 10.0, 10.0, started=True) == 13.0 and due(3.0, 10.0, 10.0, started=False) == 4.0


class CostLoop:
    """Steps of a fixed predicted cost that do nothing: the scheduler's clock is exactly predictable."""

    loop_id = "cost"

    def init(self, request, instance, ctx):
        p = request.params
        return LoopState(request.request_id, self.loop_id, total_steps=p["steps"], values={"cost": p["cost"]})

    def next(self, state):
        if state.step >= state.total_steps:
            return Done()
        return WorkPlan(WorkUnitKind.DIFFUSION_STEP, lambda x: {}, {}, cost_s=state.values["cost"])

    def advance(self, state, result):
        state.step += 1
        return state

    def finalize(self, state):
        return LoopResult({"steps": state.step})


def serve_stream(policy: SchedulingPolicy, ticks: int = 160) -> dict[str, float]:
    """A 20 s request amid a 2 s request every 2 ticks of 1 s (the stream alone fills the engine); the
    clock at each request's end."""
    done: dict[str, float] = {}
    sched = Scheduler(
        LoopContext(), AdmissionController(Budget()), CostModel(), SchedulerConfig(policy=policy)
    )
    sched.on_event = lambda e: e.kind == "done" and done.setdefault(e.request_id, sched.clock)
    loop = CostLoop()
    sched.submit(loop, Request("long", params={"steps": 20, "cost": 1.0}), None)
    for i in range(ticks):
        if i % 2 == 0:
            sched.submit(loop, Request(f"s{i}", params={"steps": 2, "cost": 1.0}), None)
        sched.step()
    return done


def test_aging_bound_one_long_request_amid_a_stream_of_short_ones_finishes_within_the_factor():
    done = serve_stream(SchedulingPolicy("auto", max_wait_factor=3.0))
    # its solo time is 20 s of predicted work; its end is seen at the next tick, one 1 s step later
    assert done["long"] <= 3.0 * 20 + 1.0
    assert max(done[f"s{i}"] - i for i in range(0, 120, 2)) <= 3.0 * 2 + 20  # they waited for it once
    starved = serve_stream(SchedulingPolicy("auto", max_wait_factor=1000.0))
    assert "long" not in starved  # without the bound, shortest-remaining-first starves it
    assert max(starved[f"s{i}"] - i for i in range(0, 120, 2)) == 3.0  # and each short runs at once


def test_fifo_runs_one_request_at_a_time_in_submit_order(model, denoise):
    order = []
    engine = Engine(scheduling=SchedulingPolicy("fifo"))
    engine.on_event = lambda e: e.kind == "progress" and order.append(e.request_id)
    items = [(denoise, Request(f"r{i}", params={"steps": 3}, seed=i), model) for i in range(3)]
    engine.run_batched(items)
    assert order == ["r0"] * 3 + ["r1"] * 3 + ["r2"] * 3


def test_auto_serves_shortest_remaining_first(model, denoise):
    order = []
    engine = Engine(scheduling=SchedulingPolicy("auto", max_wait_factor=100.0))
    engine.on_event = lambda e: e.kind == "progress" and order.append(e.request_id)
    items = [(denoise, Request(f"r{i}", params={"steps": s}, seed=i), model) for i, s in enumerate([6, 2, 4])]
    engine.run_interleaved(items)
    assert order == ["r1"] * 2 + ["r2"] * 4 + ["r0"] * 6


def mixed_items(model, denoise, decode):
    items = [
        (denoise, Request(f"d{i}", params={"steps": 2 + i, "tiles": i % 3}, seed=i), model) for i in range(4)
    ]
    items += [(decode, Request(f"a{i}", params={"max_tokens": 3 + i}, seed=10 + i), model) for i in range(2)]
    return items


@pytest.mark.parametrize("policy", ["auto", "fifo", "fair"])
def test_outputs_do_not_change_with_the_policy(model, denoise, decode, policy):
    scheduling = SchedulingPolicy(policy)
    assert_interleave_parity(
        lambda: Engine(scheduling=scheduling), lambda: mixed_items(model, denoise, decode)
    )
    report = check_batched_parity(
        lambda: Engine(scheduling=scheduling), lambda: mixed_items(model, denoise, decode), tol=1e-5
    )
    assert report.ok


def test_auto_learns_the_batch_curve_and_records_predicted_vs_measured(model, denoise):
    engine = Engine(scheduling=SchedulingPolicy("auto"))
    items = [(denoise, Request(f"r{i}", params={"steps": 4}, seed=i), model) for i in range(4)]
    results = engine.run_batched(items)
    serial = Engine().run_serial(items)
    for a, b in zip(results, serial, strict=True):
        torch.testing.assert_close(a.outputs["latents"], b.outputs["latents"], atol=1e-5, rtol=0)
    [curve] = [c for k, c in engine.cost.curves().items() if k[0] == "denoise"]
    assert 1 in curve.seconds and curve.batched()  # measured alone, and probed batched
    acc = engine.cost.accuracy()
    assert acc["predicted_s"] > 0 and acc["measured_s"] > 0 and acc["median_rel_error"] >= 0


def test_metrics_export_the_policy_predicted_vs_measured_cost_and_decisions(model, denoise):
    from fv_core.serving.metrics import Metrics

    engine, metrics = Engine(scheduling=SchedulingPolicy("auto")), Metrics()
    metrics.watch_engine(engine)
    engine.run_batched([(denoise, Request(f"r{i}", params={"steps": 3}, seed=i), model) for i in range(3)])
    text = metrics.render().decode()
    assert 'fv_scheduling_policy{policy="auto"} 1.0' in text
    for name, count in engine.decisions.as_dict().items():
        assert f'fv_schedule_decisions_total{{decision="{name}"}} {float(count)}' in text
    assert (
        engine.decisions.probe >= 1 and engine.decisions.batch >= engine.decisions.probe
    )  # first tick probes
    acc = engine.cost.accuracy()
    assert f"fv_step_cost_predicted_seconds_total {acc['predicted_s']!r}" in text
    assert f"fv_step_cost_measured_seconds_total {acc['measured_s']!r}" in text and acc["measured_s"] > 0
    assert f"fv_step_cost_error_median_warm {acc['median_rel_error_warm']!r}" in text


class Unbatchable:
    """A loop whose plans carry no batch key: no batch curve is measured, so decisions use predictions only."""

    def __init__(self, loop) -> None:
        self.loop, self.loop_id = loop, loop.loop_id
        self.init, self.advance, self.finalize = loop.init, loop.advance, loop.finalize
        if hasattr(loop, "estimate"):
            self.estimate = loop.estimate

    def next(self, state):
        plan = self.loop.next(state)
        if isinstance(plan, WorkPlan):
            plan.batch_key = None
        return plan


def serve_two_families(
    policy: SchedulingPolicy, model, denoise, decode, ticks: int = 120
) -> dict[str, float]:
    """One 8-step denoise request (8 ms predicted) amid a 4-token AR request (2 ms) every 4 ticks, on one
    engine; the clock at each request's end."""
    denoise, decode = Unbatchable(denoise), Unbatchable(decode)
    done: dict[str, float] = {}
    sched = Scheduler(
        LoopContext(), AdmissionController(Budget()), CostModel(), SchedulerConfig(policy=policy)
    )
    sched.on_event = lambda e: e.kind == "done" and done.setdefault(e.request_id, sched.clock)
    sched.submit(denoise, Request("video", params={"steps": 8}), model)
    for i in range(ticks):
        if i % 4 == 0:
            sched.submit(decode, Request(f"chat{i}", params={"max_tokens": 4, "temperature": 0.0}), model)
        sched.step()
    return done


def test_one_family_does_not_starve_another_on_a_mixed_engine(model, denoise, decode):
    solo = 8 * denoise.step_cost_s
    done = serve_two_families(SchedulingPolicy("auto", max_wait_factor=3.0), model, denoise, decode)
    assert done["video"] <= 3 * solo + denoise.step_cost_s  # AR and denoise steps priced in one currency
    assert sum(k.startswith("chat") for k in done) >= 25  # and the chats kept being served
    starved = serve_two_families(SchedulingPolicy("auto", max_wait_factor=1000.0), model, denoise, decode)
    assert "video" not in starved


def test_batch_curves_take_the_median_and_the_error_after_warm_up_is_kept_apart():
    cost = CostModel()
    assert not cost.warm(KEY, 1)
    for seconds in (2.0, 1.0, 1.0):
        cost.observe_call(KEY, 1, seconds)
    assert cost.batch_cost(KEY, 1) == 1.0  # the median of the latest calls: one slow call moves nothing
    assert cost.warm(KEY, 1) and not cost.warm(KEY, 2)  # three calls of one row measured, none of two
    cost.record(0.5, 1.0)  # a call priced during warm-up, 100 % off
    cost.record(1.0, 1.1, warm=True)
    acc = cost.accuracy()
    assert acc["median_rel_error"] == pytest.approx(0.55) and acc["median_rel_error_warm"] == pytest.approx(
        0.1
    )
