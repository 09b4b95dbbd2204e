"""The step scheduler: schedule -> execute -> update, one tick at a time.

Each tick (``step``): drop cancelled requests at the step boundary, admit waiting requests while the named
budgets allow (AdmissionController), plan each running request's next WorkUnit, let the policy
(``SchedulerConfig.policy``, policy.py: fair / fifo / auto) pick the calls, run them, fold the results back
(LoopRunner.complete), stream events, finish loops that returned Done (refunding their reservation). A call
is priced before it runs (batch curve, else the calibrated plans) and measured after (seconds; peak bytes
once per key, memory.py): measurements feed the cost model, predictions advance the clock the auto
policy counts ages on. A batched call that runs out of memory is split, its rows retried alone (oom.py).

Loops may define ``estimate(state) -> (raw_seconds, peak_bytes)`` for their remaining work; otherwise
admission budgets the first plan's cost times the steps left (``total_steps``; when unknown, what such loops
took before, at most ``open_loop_steps``). Loops writing a paged KV pool define ``kv_need(state) -> (pool,
pages)``: the most pages the stage holds at once (with pages an earlier stage handed it); a request is
admitted only when the pool has them unpromised (it waits, never runs out). A stage's reservation is returned
before the next stage's is made; the next stage goes ahead of new requests: handed pages count once.

``at_boundary(fn)`` runs ``fn(scheduler)`` at the start of the next tick, before cancellations and admission:
no step runs and nothing is admitted meanwhile (a weight sync swaps weights there). Loops that pin their
weights at init (``state.values["weights_versions"]``: component -> version) keep them across a sync; when a
request leaves, an instance with retired versions (``retired_versions``) frees those no live request pins
(``release_versions``; ``pins(instance)`` lists them).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

from fv_core.errors import Cancelled, ConfigError, QueueFull
from fv_core.loop.context import LoopContext
from fv_core.loop.contracts import Done, Loop, LoopResult, LoopState, StepResult, StreamEvent, WorkPlan
from fv_core.loop.runner import ActiveLoop, LoopRunner, check_params, run_plan
from fv_core.program.program import Program
from fv_core.runtime.admission import AdmissionController, Estimate, Reservation
from fv_core.runtime.batching import Batch, Batching, Outcome, group_calls, may_share, measured_s
from fv_core.runtime.cost import CostModel, calibration_key, curve_key
from fv_core.runtime.memory import measure_peak, untimed
from fv_core.runtime.oom import OOM_ERRORS, cap_rows, out_of_memory, run_rows
from fv_core.runtime.policy import Candidate, Decisions, SchedulingPolicy, edf_key, pick_auto

WorkItem = tuple[Loop | Program, Any, Any]  # (loop or program, request, instance)


def settle(future: Future, fn: Callable[..., Any], *args: Any) -> None:
    """Run ``fn(*args)`` into ``future``: its value, or the error it raised (unless cancelled first)."""
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(fn(*args))
    except Exception as exc:
        future.set_exception(exc)


@dataclass(slots=True)
class SchedulerConfig:
    """Knobs of one scheduler."""

    batching: Batching = True  # which plans with equal batch keys run as one call (see batching.py)
    max_batch_rows: int = 8  # rows per batched call
    max_units_per_tick: int = 0  # WorkUnits per tick; 0: one per running request
    open_loop_steps: int = 256  # steps budgeted for a loop whose total_steps is None
    policy: SchedulingPolicy = field(default_factory=SchedulingPolicy)  # which calls each tick makes


@dataclass(slots=True, eq=False)
class Entry:
    """One request inside the scheduler."""

    request: Any  # the request as submitted (program-level for programs)
    runnable: Loop | Program  # what the request runs
    instance: Any  # live instance every stage is bound to
    cancel_reason: str | None = None  # set by cancel(), applied at the next step boundary
    phase: str = "new"  # new -> waiting -> running -> finished
    seq: int = 0  # submit order (FIFO tie-break)
    deadline: float | None = None  # wall-clock time its work is due (real-time sessions; see policy.py)
    arrived: float = 0.0  # scheduler clock at submit
    served_s: float = 0.0  # predicted seconds of the steps it ran, each priced alone
    stage_from_s: float = 0.0  # served_s when its current program stage started
    started: bool = False  # ran a step
    stage: int = 0  # current program stage (0 for a plain loop)
    stage_results: dict[str, LoopResult] = field(default_factory=dict)  # finished program stages
    active: ActiveLoop | None = None  # current loop in flight
    pending: WorkPlan | Done | None = None  # planned step not yet run
    need: Estimate | None = None  # worst-case needs of the current stage
    ratio: float = 1.0  # calibration ratio the estimate used; steps are charged at the same rate
    reservation: Reservation | None = None  # what admission granted
    result: LoopResult | None = None  # final result
    error: BaseException | None = None  # failure or Cancelled

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def active_loop(self) -> ActiveLoop:
        """The loop in flight; set by ``Scheduler._start_stage`` before the entry is registered."""
        assert self.active is not None, f"request {self.request_id!r} has no loop started"
        return self.active


Call = Entry | Batch  # one body call: a lone entry's pending plan, or a batch
Priced = tuple[Hashable | None, int, float]  # a call's batch curve key, rows and predicted seconds


@dataclass(slots=True)
class SchedulerOutput:
    """What one tick decided."""

    calls: list[Call]  # body calls to make, in service order
    finished: list[Entry]  # loops whose next() returned Done
    priced: list[Priced] = field(default_factory=list)  # per call, before it runs


class Scheduler:
    """Step-granular scheduler over many requests' loops."""

    def __init__(
        self,
        ctx: LoopContext,
        admission: AdmissionController,
        cost: CostModel,
        config: SchedulerConfig | None = None,
        on_event: Callable[[StreamEvent], None] | None = None,
        runner: LoopRunner | None = None,
    ) -> None:
        self.ctx, self.admission, self.cost = ctx, admission, cost
        self.config = config or SchedulerConfig()
        self.on_event = on_event
        self.runner = runner or LoopRunner()
        self.entries: dict[str, Entry] = {}  # live requests by id
        self.waiting: list[tuple[int, int, int, Entry]] = []  # heap of (rank, -priority, seq, entry)
        self.running: deque[Entry] = deque()  # service order, least recently served first
        self.n_waiting = 0  # live entries in waiting
        self.tick = 0  # ticks run
        self.clock = 0.0  # predicted seconds of the calls run so far (ages are counted on it)
        self.decisions = Decisions()  # what schedule() decided, counted
        self._lead: Entry | None = None  # auto: the lead of the last call
        self._seq = itertools.count()
        self._cancel_ids: set[str] = set()  # cancel requests, applied at the next boundary
        self._boundary: deque[tuple[Callable[[Scheduler], Any], Future]] = deque()  # see at_boundary

    # -- intake -------------------------------------------------------------------------------------

    def submit(
        self,
        runnable: Loop | Program,
        request: Any,
        instance: Any,
        state: LoopState | None = None,
        deadline: float | None = None,
    ) -> Entry:
        """Queue a request (``deadline``: see policy.py); raises QueueFull, AdmissionInfeasible, or
        ConfigError for a duplicate id."""
        if request.request_id in self.entries:
            raise ConfigError(f"request_id {request.request_id!r} is already in flight; use a unique id")
        if state is None:
            check_params(request, getattr(instance, "card", None))
        if self.n_waiting >= self.admission.budget.max_waiting:
            self._admit()  # places freed since the last tick first go to those already waiting
        if self.n_waiting >= self.admission.budget.max_waiting:
            retry = self.admission.retry_after_s()
            raise QueueFull(
                f"busy: {self.n_waiting} requests waiting (limit {self.admission.budget.max_waiting}); "
                f"retry after {retry:.3f} s",
                retry_after_s=retry,
            )
        entry = Entry(request, runnable, instance, seq=next(self._seq), arrived=self.clock, deadline=deadline)
        self._start_stage(entry, state)
        self.entries[entry.request_id] = entry
        self._enqueue(entry, rank=1)
        return entry

    def cancel(self, request_id: str, reason: str = "cancelled by caller") -> bool:
        """Ask for cancellation; it takes effect at the next step boundary. Thread-safe."""
        entry = self.entries.get(request_id)
        if entry is None:
            return False
        entry.cancel_reason = reason
        self._cancel_ids.add(request_id)
        return True

    def has_work(self) -> bool:
        return bool(self.entries)

    def at_boundary(self, fn: Callable[[Scheduler], Any]) -> Future:
        """Run ``fn(self)`` at the next step boundary (the start of the next ``step``), on the thread that
        ticks; the Future holds its return value or error. Thread-safe."""
        future: Future = Future()
        self._boundary.append((fn, future))
        return future

    def run_boundary(self) -> None:
        """Run the callbacks ``at_boundary`` queued (``step`` does it first; an engine, once idle)."""
        while self._boundary:
            fn, future = self._boundary.popleft()
            settle(future, fn, self)

    def pins(self, instance: Any) -> dict[str, dict[str, str]]:
        """Request id -> the weights versions (component -> version) it pinned at init, for the live
        requests on ``instance``."""
        return {
            rid: e.active.state.values.get("weights_versions", {})
            for rid, e in self.entries.items()
            if e.instance is instance and e.active is not None
        }

    def abort(self, error: BaseException) -> None:
        """End every live request with ``error`` (engine shutdown or an internal failure)."""
        for entry in list(self.entries.values()):
            self._close(entry, error, StreamEvent("error", entry.request_id, data=error))

    # -- one tick -----------------------------------------------------------------------------------

    def step(self) -> None:
        """One tick: boundary work, then schedule -> execute -> update."""
        self.run_boundary()
        self._drop_cancelled()
        self._admit()
        out = self.schedule()
        self.update(out, self.execute(out))
        self.tick += 1

    def schedule(self) -> SchedulerOutput:
        """Plan the running requests' next steps; the policy picks the calls; each call is priced."""
        policy = self.config.policy.policy
        limit = (self.config.max_units_per_tick if policy == "fair" else 0) or len(self.running)
        selected, finished = self._ready(limit)
        calls: list[Call] = []
        if selected and policy == "fair":  # deadline work first (stable: the rest least recently served)
            ordered = sorted(selected, key=lambda e: edf_key(e)[:2])
            calls = group_calls(ordered, self.config.batching, self.config.max_batch_rows)
            calls = cap_rows(calls, self.cost, self.admission.headroom_bytes, self.config.max_batch_rows)
        elif selected and policy == "fifo":  # earliest deadline, else the oldest; none while it finishes
            calls = [e for e in [min(selected + finished, key=edf_key)] if e in selected]
        elif selected:
            calls = [self._pick_auto(selected)]
        out = SchedulerOutput(calls, finished)
        for call in calls:
            out.priced.append(self._price(call))
        return out

    def execute(self, out: SchedulerOutput) -> list[Outcome]:
        """Run each call: interceptors may answer plans; the rest run as one body call."""
        results: list[Outcome] = []
        for call, (key, rows, _) in zip(out.calls, out.priced, strict=True):
            try:
                metered = measure_peak(self.ctx.device) if self.cost.wants_peak(key, rows) else nullcontext()
                with metered as peak:
                    res = self._run_alone(call) if isinstance(call, Entry) else self._run_batch(call)
                if peak is not None and measured_s(res, len(getattr(call, "entries", [call]))) > 0:
                    self.cost.observe_peak(key, rows, peak.bytes)  # a call that ran whole: its peak
                    untimed(res)  # the tracking slowed it: its seconds teach the cost model nothing
                results.append(res)
            except OOM_ERRORS as exc:  # only a lone call gets here: a batch retries its rows alone
                assert isinstance(call, Entry) and isinstance(call.pending, WorkPlan)
                results.append(
                    out_of_memory(call.request_id, call.pending, 1, self.admission.budget.memory_bytes, exc)
                )
            except Exception as exc:  # a failing body fails the requests of its call only
                results.append(exc)
        return results

    def update(self, out: SchedulerOutput, results: list[Outcome]) -> None:
        """Fold results back, stream events, spend reservations, learn the costs, finish Done loops."""
        for call, res, (key, rows, predicted) in zip(out.calls, results, out.priced, strict=True):
            if isinstance(call, Entry):
                assert not isinstance(res, list), "a lone call returns one result"
                self._fold(call, res)
            else:
                for i, entry in enumerate(call.entries):
                    self._fold(entry, res[i] if isinstance(res, list) else res)
            measured = measured_s(res, len(call.entries) if isinstance(call, Batch) else 1)
            if measured > 0:
                self.cost.record(predicted, measured, self.cost.warm(key, rows))
                self.cost.observe_call(key, rows, measured)
            self.clock += predicted
        for entry in out.finished:
            self._finish_stage(entry)

    # -- helpers ------------------------------------------------------------------------------------

    def _run_alone(self, entry: Entry) -> StepResult:
        plan = entry.pending
        assert isinstance(plan, WorkPlan), "a scheduled entry has a pending WorkPlan"
        return self.runner.before(entry.active_loop, plan) or run_plan(plan, self.ctx.profile)

    def _run_batch(self, batch: Batch) -> list[StepResult | BaseException]:
        budget = self.admission.budget.memory_bytes
        return run_rows(self.runner, batch, self.ctx.profile, self.cost, budget, self.decisions)

    def _ready(self, limit: int) -> tuple[list[Entry], list[Entry]]:
        """Up to ``limit`` running entries with their next plan, least recently served first (they go
        to the back of the service order); and the entries whose loop returned Done."""
        selected: list[Entry] = []
        finished: list[Entry] = []
        for _ in range(len(self.running)):
            if len(selected) >= limit:
                break
            entry = self.running.popleft()
            if entry.phase != "running":
                continue  # cancelled or failed: dropped lazily
            if entry.pending is None:
                entry.pending = self._plan(entry)
            (finished if isinstance(entry.pending, Done) else selected).append(entry)
        self.running.extend(selected)
        return selected, finished

    def _pick_auto(self, selected: list[Entry]) -> Call:
        """The auto policy's one call of this tick (see policy.py), its decisions counted."""
        cands = [self._candidate(e) for e in selected]
        rows = self.config.max_batch_rows if self.config.batching else 1
        headroom = self.admission.headroom_bytes
        call, why = pick_auto(cands, self.cost, self.config.policy, self.clock, self._lead, rows, headroom)
        lead = call[0].entry
        if self._lead is not None and lead is not self._lead and self._lead in selected:
            self.decisions.preempt += 1
        self.decisions.probe += why == "probe"
        self.decisions.late += call[0].due <= self.clock
        self._lead = lead
        if len(call) == 1:
            return lead
        plans = [c.entry.pending for c in call]
        invariant = self.config.batching == "invariant"
        return Batch([c.entry for c in call], plans, sum(p.batch_size for p in plans), invariant)

    def _candidate(self, entry: Entry) -> Candidate:
        state, plan, policy = entry.active_loop.state, entry.pending, self.config.policy
        assert isinstance(plan, WorkPlan), "a candidate has a pending WorkPlan"
        step_s, predicted = self.cost.solo_s(state, plan), self.cost.predict(state, plan)
        scale = step_s / predicted if predicted > 0 else 1.0  # the estimate in the clock's currency
        left = max(self._remaining(entry) * scale, step_s)  # at least its next step (an estimate may omit it)
        if isinstance(prog := entry.runnable, Program):  # and its later stages, as they took before
            left += self.cost.stages_s(
                prog.name, [s.name for s in prog.stages[entry.stage + 1 :]], entry.instance
            )
        due = policy.due(entry.arrived, entry.served_s + left, left, entry.started)  # solo: done + left
        key = curve_key(state, plan) if may_share(plan, self.config.batching) else None
        return Candidate(entry, key, plan.batch_size, step_s, left, due, entry.seq, entry.deadline)

    def _price(self, call: Call) -> Priced:
        """A call's batch curve key, rows and predicted seconds (see CostModel.price_call); counted."""
        entries, plans = ([call], [call.pending]) if isinstance(call, Entry) else (call.entries, call.plans)
        self.decisions.batch += len(entries) > 1
        self.decisions.alone += len(entries) == 1
        return self.cost.price_call([e.active_loop.state for e in entries], plans)  # type: ignore[arg-type]

    def _fold(self, entry: Entry, res: StepResult | BaseException) -> None:
        """Spend the step's share of the reservation and fold its result into the loop."""
        if isinstance(res, BaseException):
            self._fail(entry, res)
            return
        plan = entry.pending
        try:
            assert isinstance(plan, WorkPlan), "a scheduled entry has a pending WorkPlan"
            assert entry.reservation is not None, "a scheduled entry is running, hence reserved"
            self.admission.consume(entry.reservation, plan.cost_s * entry.ratio)
            entry.served_s += self.cost.solo_s(entry.active_loop.state, plan)
            events = self.runner.complete(entry.active_loop, plan, res)
        except Exception as exc:
            self._fail(entry, exc)
            return
        entry.pending, entry.started = None, True
        for event in events:
            self._emit(event)

    def _plan(self, entry: Entry) -> WorkPlan | Done:
        active = entry.active_loop
        plan = self.runner.plan(active)
        return plan if isinstance(plan, Done) else self.cost.fill(active.state, plan)

    def _start_stage(self, entry: Entry, state: LoopState | None = None) -> None:
        """Init the current stage's loop, plan its first step, check it can ever fit."""
        if isinstance(entry.runnable, Program):
            loop = entry.runnable.stages[entry.stage].loop
            request = entry.runnable.stage_request(entry.stage, entry.request, entry.stage_results)
        else:
            loop, request = entry.runnable, entry.request
        entry.active = self.runner.start(loop, request, entry.instance, self.ctx, state)
        entry.pending = self._plan(entry)
        entry.need = self._estimate(entry)
        self.admission.check_feasible(entry.request_id, entry.need, entry.instance)

    def _estimate(self, entry: Entry) -> Estimate:
        plan, state, loop = entry.pending, entry.active_loop.state, entry.active_loop.loop
        kv_pool, kv_pages = loop.kv_need(state) if hasattr(loop, "kv_need") else (None, 0)
        if isinstance(plan, Done):
            return Estimate(0.0, 0, kv_pool, kv_pages)
        assert plan is not None, "_start_stage plans the first step before estimating"
        entry.ratio = self.cost.ratio(calibration_key(state, plan))
        peak = max(loop.estimate(state)[1], plan.peak_bytes) if hasattr(loop, "estimate") else plan.peak_bytes
        return Estimate(self._remaining(entry), peak, kv_pool, kv_pages)

    def _remaining(self, entry: Entry) -> float:
        """Predicted seconds of the current stage's remaining steps, run alone (calibrated)."""
        plan, state, loop = entry.pending, entry.active_loop.state, entry.active_loop.loop
        if not isinstance(plan, WorkPlan):
            return 0.0
        ratio = self.cost.ratio(calibration_key(state, plan))
        if hasattr(loop, "estimate"):
            return loop.estimate(state)[0] * ratio
        cap, known = self.config.open_loop_steps, state.total_steps
        total = self.cost.open_steps(state.loop_id, entry.instance, cap) if known is None else known
        return plan.cost_s * ratio * max(total - state.step, 1)

    def _enqueue(self, entry: Entry, rank: int) -> None:
        entry.phase = "waiting"
        self.n_waiting += 1
        heapq.heappush(self.waiting, (rank, -getattr(entry.request, "priority", 0), entry.seq, entry))

    def _admit(self) -> None:
        """Admit waiting requests in priority order while the budgets allow (no overtaking)."""
        while self.waiting:
            entry = self.waiting[0][3]
            if entry.phase == "waiting":
                assert entry.need is not None, "_start_stage estimates before enqueueing"
                reservation = self.admission.try_reserve(entry.request_id, entry.need, entry.instance)
                if reservation is None:
                    return
                entry.reservation, entry.phase = reservation, "running"
                self.running.append(entry)
                self.n_waiting -= 1
            heapq.heappop(self.waiting)

    def _drop_cancelled(self) -> None:
        while self._cancel_ids:
            entry = self.entries.get(self._cancel_ids.pop())
            if entry is not None and entry.phase in ("waiting", "running"):
                error = Cancelled(f"request {entry.request_id!r} was cancelled: {entry.cancel_reason}")
                step = entry.active_loop.state.step
                self._close(entry, error, StreamEvent("cancelled", entry.request_id, step, data=error))

    def _finish_stage(self, entry: Entry) -> None:
        assert isinstance(entry.pending, Done), "only entries whose plan returned Done finish"
        if (state := entry.active_loop.state).total_steps is None:  # how long open-ended loops run
            self.cost.observe_steps(state.loop_id, entry.instance, state.step)
        try:
            result = self.runner.finish(entry.active_loop, entry.pending.reason)
        except Exception as exc:  # e.g. non-finite outputs: this request fails, the others go on
            self._close(entry, exc, StreamEvent("error", entry.request_id, data=exc))
            return
        self._release(entry)
        program = entry.runnable
        if isinstance(program, Program):  # what this stage took prices it in later requests' remaining work
            taken, entry.stage_from_s = entry.served_s - entry.stage_from_s, entry.served_s
            self.cost.observe_stage(program.name, program.stages[entry.stage].name, entry.instance, taken)
        if isinstance(program, Program) and entry.stage + 1 < len(program.stages):
            entry.stage_results[program.stages[entry.stage].name] = result
            entry.stage += 1
            try:
                self._start_stage(entry)
            except Exception as exc:
                self._close(entry, exc, StreamEvent("error", entry.request_id, data=exc))
                return
            self._enqueue(entry, rank=0)  # later stages go ahead of new requests
            return
        if isinstance(program, Program):
            entry.stage_results[program.stages[entry.stage].name] = result
            result = program.combine(entry.stage_results)
        entry.result, entry.phase = result, "finished"
        del self.entries[entry.request_id]
        self._release_versions(entry.instance)
        self._emit(StreamEvent("done", entry.request_id, result.metrics.get("steps", 0), data=result))

    def _fail(self, entry: Entry, exc: BaseException) -> None:
        if entry.phase != "finished":
            self._close(
                entry, exc, StreamEvent("error", entry.request_id, entry.active_loop.state.step, data=exc)
            )

    def _close(self, entry: Entry, error: BaseException, event: StreamEvent) -> None:
        """End a request early: release its state and reservation, report why."""
        if entry.phase == "waiting":
            self.n_waiting -= 1
        self.runner.abandon(entry.active_loop)
        self._release(entry)
        entry.error, entry.phase, entry.pending = error, "finished", None
        self.entries.pop(entry.request_id, None)
        self._release_versions(entry.instance)
        self._emit(event)

    def _release_versions(self, instance: Any) -> None:
        """A request left: free the instance's retired weights versions no live request pins."""
        if getattr(instance, "retired_versions", None):
            instance.release_versions({p for v in self.pins(instance).values() for p in v.items()})

    def _release(self, entry: Entry) -> None:
        if entry.reservation is not None:
            self.admission.release(entry.reservation)
            entry.reservation = None

    def _emit(self, event: StreamEvent) -> None:
        if self.on_event is not None:
            self.on_event(event)
