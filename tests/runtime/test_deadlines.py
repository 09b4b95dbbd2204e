"""Deadlines (real-time sessions): earliest deadline first under every policy, on a synthetic cost model,
deadline leads batching their peers, and the admission of sessions from the predicted round."""

import pytest

from fv_core.loop import LoopContext
from fv_core.request import Request
from fv_core.runtime import AdmissionController, Budget, CostModel, Scheduler, SchedulerConfig
from fv_core.runtime.deadlines import ChunkCost, most_sessions, predict_load, refusal
from fv_core.runtime.policy import Candidate, SchedulingPolicy, pick_auto
from tests.runtime.test_policy import AUTO, KEY, CostLoop, curve


def served_order(policy: str) -> list[list[str]]:
    """The requests each tick ran: a request without a deadline submitted first, then three with
    deadlines out of order, each 2 steps of 1 predicted second."""
    sched = Scheduler(
        LoopContext(),
        AdmissionController(Budget()),
        CostModel(),
        SchedulerConfig(policy=SchedulingPolicy(policy)),
    )
    ticks: list[list[str]] = []
    sched.on_event = lambda e: e.kind == "progress" and ticks[-1].append(e.request_id)
    loop = CostLoop()
    for rid, deadline in (("bulk", None), ("late", 30.0), ("soon", 10.0), ("mid", 20.0)):
        sched.submit(loop, Request(rid, params={"steps": 2, "cost": 1.0}), None, deadline=deadline)
    while sched.has_work():
        ticks.append([])
        sched.step()
    return [t for t in ticks if t]


@pytest.mark.parametrize("policy", ["fifo", "auto"])
def test_one_call_a_tick_policies_serve_the_earliest_deadline_first_and_deadline_work_before_the_rest(policy):
    order = [rid for tick in served_order(policy) for rid in tick]
    assert order == ["soon"] * 2 + ["mid"] * 2 + ["late"] * 2 + ["bulk"] * 2


def test_fair_runs_everyone_each_tick_deadline_work_first_by_deadline():
    assert served_order("fair") == [["soon", "mid", "late", "bulk"]] * 2


def test_auto_leads_with_the_earliest_deadline_and_batches_deadline_peers_first():
    def cand(name, remaining, deadline, seq):
        return Candidate(name, KEY, 1, 1.0, remaining, float("inf"), seq, deadline)

    cands = [
        cand("short", 1.0, None, 0),
        cand("b", 9.0, 5.0, 1),
        cand("a", 9.0, 2.0, 2),
        cand("c", 3.0, 8.0, 3),
    ]
    cheap = curve({1: 1.0, 2: 1.1, 4: 1.3})  # batching pays: everyone joins, deadline work first
    call, why = pick_auto(cands, cheap, AUTO, 0.0, None, max_rows=8)
    assert why == "batch" and [c.entry for c in call] == ["a", "b", "c", "short"]
    call, _ = pick_auto(cands, cheap, AUTO, 0.0, None, max_rows=2)
    assert [c.entry for c in call] == ["a", "b"]  # the row limit cuts the latest deadlines off
    linear = curve({1: 1.0, 2: 2.0})  # batching does not pay: the earliest deadline alone, not SRPT
    assert pick_auto(cands, linear, AUTO, 0.0, None, max_rows=8) == ([cands[2]], "alone")


def test_admission_predicts_the_round_from_the_solo_chunk_and_the_batch_curve():
    shared = ChunkCost(solo_s=0.2, batched_share=0.8, curve=lambda rows: 1.0 + 0.1 * (rows - 1))
    assert shared.round_s(1) == pytest.approx(0.2)
    assert shared.round_s(4) == pytest.approx(0.2 * (0.2 * 4 + 0.8 * 1.3))  # the passes batch, the rest not
    assert ChunkCost(0.2).round_s(4) == pytest.approx(0.8)  # no batching: sessions add up
    decodes = ChunkCost(
        0.2, 0.6, lambda rows: 1.0 + 0.1 * (rows - 1), 0.3, lambda rows: 1.0 + 0.5 * (rows - 1)
    )
    assert decodes.round_s(1) == pytest.approx(0.2)
    assert decodes.round_s(4) == pytest.approx(0.2 * (0.1 * 4 + 0.6 * 1.3 + 0.3 * 2.5))  # decodes batch too
    assert most_sessions(0.4, ChunkCost(0.2)) == 1 and most_sessions(0.4, shared) == 3
    assert most_sessions(0.1, shared) == 0
    held = predict_load([0.4] * 3, shared)
    assert held.fits and held.load == pytest.approx(0.312 / 0.4)
    refused = predict_load([0.4] * 4, shared)
    assert not refused.fits
    message = refusal(refused, fps=10, frames_per_chunk=4, cost=shared)
    assert "with 3 session(s) already held, 4 sessions predict 0.368 s" in message
    assert "chunk deadline of 0.400 s" in message and "a load of 0.92" in message
    assert "holds 3 session(s) at fps=10. Fix: ask for fps <= 9.2" in message
