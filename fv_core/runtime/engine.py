"""The synchronous engine: run loops and programs under one budget.

Signatures (a work item is ``(loop_or_program, request, instance)``)::

    engine = Engine(budget=Budget(compute_s=60, memory_bytes=8 << 30), profile=Profile.SERVE,
                    device="cpu", observers=(), interceptors=(), on_event=None, max_batch_rows=8,
                    scheduling=SchedulingPolicy("auto"))   # or a deploy's scheduling section
    engine.run_one(loop, request, instance, state=None) -> LoopResult      # raises Cancelled
    engine.run_serial(items) -> list[LoopResult | None]       # one after another
    engine.run_interleaved(items) -> list[LoopResult | None]  # step by step, never batched
    engine.run_batched(items) -> list[LoopResult | None]      # step by step, compatible steps batched
    engine.cancel(request_id)                                 # at the next step boundary
    engine.at_boundary(fn) -> Future                          # fn(scheduler) between two ticks
    engine.admission.usage()                                  # reserved compute / memory / running

In the lists, ``None`` marks a cancelled request; a failed request re-raises
its error once the others finished. ``on_event`` receives every StreamEvent
(progress per step, partial outputs where declared; then ``done`` carrying
the LoopResult, or ``error`` / ``cancelled`` carrying the exception).
``state`` resumes a loop from a saved LoopState. ``freeze_heap()`` after loading
models keeps garbage-collection pauses independent of the process's heap; each run ends with
``release_heap()``, so the heap its steps freed does not stay resident while the engine is idle.
``scheduling`` picks the policy (policy.py: ``fair``, the default here, ``fifo`` or ``auto``; a deploy
file's default is ``auto``); a deploy section's ``memory_budget_bytes`` caps ``budget.memory_bytes``, which
is otherwise what the device has (memory.py: admission counts resident weights and cache budgets in it).
The engine owns one CostModel calibrated by a Profiler observer, and one AdmissionController. ``at_boundary`` (from
another thread while a run goes on, or when idle) runs ``fn(scheduler)`` between two ticks of the
run in progress, else at once: a weight sync swaps weights there.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import math
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from fv_core.card.spec import StepCostModel
from fv_core.errors import Cancelled, QueueFull
from fv_core.loop.context import LoopContext
from fv_core.loop.contracts import Loop, LoopResult, LoopState, Profile, StreamEvent
from fv_core.loop.observers import Profiler
from fv_core.program.program import Program
from fv_core.runtime.admission import AdmissionController, Budget
from fv_core.runtime.batching import Batching
from fv_core.runtime.cost import CostModel
from fv_core.runtime.memory import device_memory_bytes
from fv_core.runtime.policy import Decisions, SchedulingPolicy
from fv_core.runtime.scheduler import Entry, Scheduler, SchedulerConfig, WorkItem, settle


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def release_heap() -> None:
    """Give the allocator's free heap pages back to the OS (glibc ``malloc_trim``; a no-op elsewhere).

    glibc's dynamic mmap threshold moves tensors of the sizes a model frees onto the heap, so what a
    finished batch allocated stays resident as free heap (measured: 17-45 MiB after an 8-request
    batch of the medium Wan bench) until something trims it. An engine calls this when it goes idle;
    it takes a few milliseconds."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def freeze_heap() -> None:
    """Collect garbage, then leave every object alive now out of the cyclic collector's scans.

    Call once after loading models. Requests' per-step objects that outlive a tick get promoted
    to the oldest generation and trigger full collections; without this each one scans the whole
    process heap (torch, weights: ~180k objects, tens of ms), so their cost per step grows with
    the live requests. Frozen objects are still freed by reference counting, never by the
    cycle collector (``gc.unfreeze()`` undoes it)."""
    gc.collect()
    gc.freeze()


class Engine:
    """Runs requests' loops step by step; see the module docstring for the API."""

    def __init__(
        self,
        budget: Budget | None = None,
        *,
        profile: Profile = Profile.SERVE,
        device: str | torch.device = "cpu",
        observers: Sequence[Any] = (),
        interceptors: Sequence[Any] = (),
        on_event: Callable[[StreamEvent], None] | None = None,
        cost_model: CostModel | None = None,
        max_batch_rows: int = 8,
        max_units_per_tick: int = 0,
        scheduling: Any = None,
    ) -> None:
        self.cost = cost_model or CostModel()
        self.profiler = Profiler(self.cost)
        self.ctx = LoopContext(
            profile, torch.device(device), (self.profiler, *observers), tuple(interceptors)
        )
        self.policy = SchedulingPolicy.from_settings(scheduling)
        self.decisions = Decisions()  # what its schedulers decided, counted over every run
        cap = getattr(scheduling, "memory_budget_bytes", None)
        budget = budget or Budget()
        if cap is not None:
            budget.memory_bytes = min(budget.memory_bytes, cap)
        elif math.isinf(budget.memory_bytes):  # default: what the device has (admission subtracts residents)
            budget.memory_bytes = device_memory_bytes(device)
        self.admission = AdmissionController(budget)
        self.on_event = on_event
        self.max_batch_rows = max_batch_rows
        self.max_units_per_tick = max_units_per_tick
        self._scheduler: Scheduler | None = None
        self._cancel_later: dict[str, str] = {}
        self._lock = threading.Lock()  # guards _scheduler for at_boundary callers on other threads

    def register_cost(self, loop_id: str, step_cost: StepCostModel) -> None:
        """Price plans of ``loop_id`` that carry no cost_s by a LoopSpec step cost model."""
        self.cost.register(loop_id, step_cost)

    def scheduler(self, batching: Batching) -> Scheduler:
        """A scheduler sharing this engine's context, budget, cost model and event sink."""
        config = SchedulerConfig(batching, self.max_batch_rows, self.max_units_per_tick, policy=self.policy)
        sched = Scheduler(self.ctx, self.admission, self.cost, config, self.on_event)
        sched.decisions = self.decisions
        return sched

    def run_one(
        self, loop: Loop | Program, request: Any, instance: Any, state: LoopState | None = None
    ) -> LoopResult:
        """Run one request alone (``state``: resume from a saved LoopState)."""
        [entry] = self._drive([(loop, request, instance)], batching=False, state=state)
        if entry.error is not None:
            raise entry.error
        assert entry.result is not None, "a request that ended without an error has a result"
        return entry.result

    def run_serial(self, items: Sequence[WorkItem]) -> list[LoopResult | None]:
        entries = [e for item in items for e in self._drive([item], batching=False)]
        return self._results(entries)

    def run_interleaved(self, items: Sequence[WorkItem]) -> list[LoopResult | None]:
        return self._results(self._drive(items, batching=False))

    def run_batched(self, items: Sequence[WorkItem], batching: Batching = True) -> list[LoopResult | None]:
        """Step by step, compatible steps batched (``"invariant"``: only through their invariant_body)."""
        return self._results(self._drive(items, batching=batching))

    def cancel(self, request_id: str, reason: str = "cancelled by caller") -> None:
        """Cancel at the next step boundary (or before it starts, if not yet submitted)."""
        if self._scheduler is None or not self._scheduler.cancel(request_id, reason):
            self._cancel_later[request_id] = reason

    def at_boundary(self, fn: Callable[[Scheduler], Any]) -> Future:
        """``fn(scheduler)`` at the next step boundary of the run in progress, or at once when idle."""
        with self._lock:
            if self._scheduler is not None:
                return self._scheduler.at_boundary(fn)
        future: Future = Future()
        settle(future, fn, self.scheduler(batching=False))
        return future

    def _drive(
        self, items: Sequence[WorkItem], batching: Batching, state: LoopState | None = None
    ) -> list[Entry]:
        """Submit items as the queue allows and tick until all finish."""
        sched = self.scheduler(batching)
        with self._lock:
            self._scheduler = sched
        pending, entries = deque(items), []
        try:
            while pending or sched.has_work():
                while pending:
                    try:
                        entry = sched.submit(*pending[0], state=state)
                    except QueueFull:
                        if not sched.has_work():
                            raise
                        break
                    pending.popleft()
                    entries.append(entry)
                    if entry.request_id in self._cancel_later:
                        sched.cancel(entry.request_id, self._cancel_later.pop(entry.request_id))
                sched.step()
        except BaseException as exc:
            sched.abort(exc)  # nothing stays reserved when a run fails
            raise
        finally:
            with self._lock:
                self._scheduler = None
            sched.run_boundary()  # callbacks queued after the last tick
            release_heap()  # idle: what the run freed goes back to the OS
        return entries

    @staticmethod
    def _results(entries: list[Entry]) -> list[LoopResult | None]:
        failed = next((e.error for e in entries if e.error and not isinstance(e.error, Cancelled)), None)
        if failed is not None:
            raise failed
        return [e.result for e in entries]
