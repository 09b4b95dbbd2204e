"""Admission counts KV pages: a request is admitted only when its pool has its worst-case pages unpromised
(it waits otherwise, never runs out mid-run), a request that needs more than the whole pool is refused
with the numbers and the fix, and reservations return on finish, cancel and failure."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fv_core.errors import AdmissionInfeasible
from fv_core.kv import KVPoolFull, KVSeq, PagedKVPool
from fv_core.loop import Done, LoopResult, LoopState, StepResult, WorkPlan, WorkUnitKind
from fv_core.request import Request
from fv_core.runtime import AdmissionController, Engine, Estimate


def pool(pages: int) -> PagedKVPool:
    return PagedKVPool(1, 1, 2, page_size=4, num_pages=pages)


def test_pages_are_reserved_per_pool_and_returned():
    a, b, ctl = pool(6), pool(2), AdmissionController()
    need = Estimate(0.0, 0, a, 3)
    first, second = ctl.try_reserve("r1", need, None), ctl.try_reserve("r2", need, None)
    assert first is not None and second is not None and a.reserved_pages == 6
    assert ctl.try_reserve("r3", need, None) is None  # waits: the pool's pages are all promised
    assert ctl.try_reserve("r4", Estimate(0.0, 0, b, 2), None) is not None  # another pool: its own count
    ctl.release(first)
    ctl.release(first)  # a second release refunds nothing
    assert a.reserved_pages == 3 and ctl.try_reserve("r3", need, None) is not None


def test_controllers_on_one_pool_share_its_count():
    shared = pool(4)
    assert AdmissionController().try_reserve("r1", Estimate(0.0, 0, shared, 3), None) is not None
    assert AdmissionController().try_reserve("r2", Estimate(0.0, 0, shared, 2), None) is None


def test_a_refusal_by_another_budget_reserves_no_page():
    p, ctl = pool(8), AdmissionController()
    ctl.budget.max_running = 1
    assert ctl.try_reserve("r1", Estimate(0.0, 0, p, 2), None) is not None
    assert ctl.try_reserve("r2", Estimate(0.0, 0, p, 2), None) is None and p.reserved_pages == 2


def test_more_pages_than_the_pool_is_infeasible_with_numbers_and_fix():
    with pytest.raises(
        AdmissionInfeasible,
        match=r"KV needs 5 pages of 4 tokens .* the KV pool holds 4 .*Fix: lower max_tokens",
    ):
        AdmissionController().check_feasible("big", Estimate(0.0, 0, pool(4), 5), None)


class TokenLoop:
    """Writes one token's keys/values per step into ``pool`` (``params["tokens"]`` steps); its worst case is
    every token at once."""

    def __init__(self, kv: PagedKVPool, declare: bool = True) -> None:
        self.pool = kv
        if declare:
            self.kv_need = lambda state: (kv, kv.pages_for(state.total_steps))

    def init(self, request: Any, instance: Any = None, ctx: Any = None) -> LoopState:
        state = LoopState(
            request_id=request.request_id, loop_id="tokens", total_steps=request.params["tokens"]
        )
        state.values["seq"] = KVSeq()
        return state

    def next(self, state: LoopState) -> WorkPlan | Done:
        if state.step == state.total_steps:
            return Done()
        fail = state.values.get("fail_at") == state.step
        return WorkPlan(kind=WorkUnitKind.AR_TOKEN, body=_fail if fail else _token, inputs={}, cost_s=0.0)

    def advance(self, state: LoopState, result: StepResult) -> LoopState:
        state.values["seq"] = self.pool.append(state.values["seq"], result.outputs["k"], result.outputs["v"])
        state.step += 1
        return state

    def finalize(self, state: LoopState) -> LoopResult:
        self.release(state)
        return LoopResult(outputs={"tokens": torch.tensor(state.step)})

    def release(self, state: LoopState) -> None:
        self.pool.release(state.values["seq"])
        state.values["seq"] = KVSeq()


def _token(inputs: dict[str, Any]) -> dict[str, Any]:
    return {"k": torch.ones(1, 1, 1, 2), "v": torch.ones(1, 1, 1, 2)}


def _fail(inputs: dict[str, Any]) -> dict[str, Any]:
    raise RuntimeError("the step failed")


def requests(n: int, tokens: int = 8) -> list[Request]:
    return [Request(f"r{i}", params={"tokens": tokens}) for i in range(n)]


def test_requests_beyond_the_pool_wait_instead_of_running_out():
    kv = pool(4)  # 2 requests of 8 tokens (2 pages each) at once
    engine = Engine()
    running: list[float] = []
    engine.on_event = lambda e: running.append(engine.admission.usage()["running"])
    loop = TokenLoop(kv)
    results = engine.run_batched([(loop, r, None) for r in requests(5)])
    assert all(r is not None for r in results) and max(running) == 2
    assert kv.reserved_pages == 0 and kv.used_pages == 0
    with pytest.raises(KVPoolFull):  # the same requests, with no pages declared, run out mid-run
        Engine().run_batched([(TokenLoop(kv, declare=False), r, None) for r in requests(5)])


def test_reserved_pages_return_on_cancel_and_failure():
    kv, engine = pool(4), Engine()
    sched = engine.scheduler(batching=True)
    loop = TokenLoop(kv)
    entries = [sched.submit(loop, r, None) for r in requests(3)]
    entries[1].active_loop.state.values["fail_at"] = 2
    for _ in range(2):
        sched.step()
    assert kv.reserved_pages == 4 and entries[2].phase == "waiting"
    sched.cancel("r0")
    while sched.has_work():
        sched.step()
    assert isinstance(entries[1].error, RuntimeError) and entries[2].result is not None
    assert kv.reserved_pages == 0 and kv.used_pages == 0 and engine.admission.usage()["running"] == 0
