"""AsyncEngine: the server's front of an Engine.

All model work (loop init, steps, finalize) runs on one worker thread; the
event loop only queues commands and receives events, so ``submit`` answers at
once whatever the worker is doing: the queue limit is counted here (QueueFull),
and a request the worker cannot admit (AdmissionInfeasible, a failing init)
ends with that error on its stream. API::

    aengine = AsyncEngine(Engine(budget=...), batching=True, freeze_heap=False)
    async with aengine:                                   # start() / stop()
        rid = await aengine.submit(loop, request, instance)   # QueueFull raises here
        async for event in aengine.stream(rid): ...       # progress ... then done / error / cancelled
        aengine.cancel(rid)                               # at the next step boundary
        result = await aengine.result(rid)                # LoopResult, or raises Cancelled / the error
        value = await asyncio.wrap_future(aengine.at_boundary(fn))  # fn(scheduler) between two ticks

``at_boundary`` is thread-safe; its ``fn`` runs on the worker after the commands queued before it
(a request submitted earlier is initialised first) and before the next tick, so no step runs
meanwhile: a weight sync swaps weights there.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from fv_core.errors import Cancelled, ConfigError, QueueFull
from fv_core.loop.contracts import LoopResult, StreamEvent
from fv_core.request import TERMINAL_EVENTS
from fv_core.runtime.batching import Batching
from fv_core.runtime.engine import Engine, release_heap
from fv_core.runtime.engine import freeze_heap as freeze_loaded_heap
from fv_core.runtime.scheduler import Scheduler, settle


@dataclass(slots=True)
class _Record:
    """Event-loop side of one request."""

    outcome: asyncio.Future[LoopResult]  # LoopResult or exception
    events: asyncio.Queue[StreamEvent] = field(default_factory=asyncio.Queue)  # stream events in order


class AsyncEngine:
    """Submit / stream / cancel / result over one worker thread."""

    def __init__(
        self, engine: Engine | None = None, *, batching: Batching = True, freeze_heap: bool = False
    ) -> None:
        self.engine = engine or Engine()
        self.batching = batching
        self.freeze_heap = freeze_heap  # on start, leave the loaded heap out of GC scans (see freeze_heap)
        self._commands: queue.SimpleQueue[Callable[[], object] | None] = queue.SimpleQueue()
        self._records: dict[str, _Record] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._retry_after_s = 0.0  # the worker's latest estimate, for QueueFull answers
        self._boundary: set[Future] = set()  # at_boundary futures not yet settled (stop cancels them)

    @property
    def _event_loop(self) -> asyncio.AbstractEventLoop:
        """The event loop ``start`` ran on."""
        if self._loop is None:
            raise RuntimeError("AsyncEngine is not started; use `async with` or await start() first")
        return self._loop

    async def __aenter__(self) -> AsyncEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self.freeze_heap:
            freeze_loaded_heap()
        self._sched = self.engine.scheduler(self.batching)
        self._sched.on_event = self._on_event
        self._thread = threading.Thread(target=self._work, name="fv-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Cancel what is in flight and join the worker."""
        self._commands.put(None)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        for future in list(self._boundary):  # queued behind the stop: they never run
            future.cancel()

    @property
    def in_flight(self) -> int:
        """Requests submitted whose result was not yet taken."""
        return len(self._records)

    async def submit(self, loop: Any, request: Any, instance: Any, deadline: float | None = None) -> str:
        """Queue a request without waiting for the worker; returns its id. Raises QueueFull when the
        requests in flight fill the budget's running and waiting places. ``deadline``: the wall-clock
        (``time.monotonic``) time its work is due; deadline work runs first, earliest first (policy.py)."""
        rid = request.request_id
        if rid in self._records:
            raise ConfigError(f"request_id {rid!r} is already in flight. Fix: use a unique id.")
        budget = self.engine.admission.budget
        places = budget.max_running + budget.max_waiting
        if len(self._records) >= places:
            raise QueueFull(
                f"busy: {len(self._records)} requests in flight (limit {places}); retry after "
                f"{self._retry_after_s:.3f} s",
                retry_after_s=self._retry_after_s,
            )
        self._records[rid] = _Record(outcome=self._event_loop.create_future())

        def command() -> None:
            try:
                self._sched.submit(loop, request, instance, deadline=deadline)
            except BaseException as exc:  # refused or failed to start: it ends on its stream
                self._on_event(StreamEvent("error", rid, data=exc))

        self._commands.put(command)
        return rid

    async def stream(self, request_id: str) -> AsyncIterator[StreamEvent]:
        """Events of one request, in order, ending with done / error / cancelled."""
        record = self._records[request_id]
        while True:
            event = await record.events.get()
            yield event
            if event.kind in TERMINAL_EVENTS:
                return

    def cancel(self, request_id: str, reason: str = "cancelled by caller") -> None:
        self._commands.put(lambda: self._sched.cancel(request_id, reason))

    def at_boundary(self, fn: Callable[[Scheduler], Any]) -> Future:
        """Run ``fn(scheduler)`` on the worker between two ticks; the Future holds its value or error."""
        if self._thread is None:
            raise RuntimeError("AsyncEngine is not started; use `async with` or await start() first")
        future: Future = Future()
        self._boundary.add(future)
        future.add_done_callback(self._boundary.discard)
        self._commands.put(lambda: settle(future, fn, self._sched))
        return future

    async def result(self, request_id: str) -> LoopResult:
        """The final result; raises Cancelled or the request's error."""
        record = self._records[request_id]
        try:
            return await record.outcome
        finally:
            self._records.pop(request_id, None)

    # -- worker thread -----------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            block = not self._sched.has_work()
            try:
                while True:
                    command = self._commands.get(block=block)
                    block = False
                    if command is None:
                        self._sched.abort(Cancelled("engine stopped"))
                        return
                    command()
            except queue.Empty:
                pass
            try:
                if self._sched.has_work():
                    self._sched.step()
                    self._retry_after_s = self.engine.admission.retry_after_s()
                    if not self._sched.has_work():
                        release_heap()  # idle: what the run freed goes back to the OS
            except Exception as exc:  # an internal failure ends every request, not the worker
                self._sched.abort(exc)

    def _on_event(self, event: StreamEvent) -> None:
        self._event_loop.call_soon_threadsafe(self._deliver, event)

    def _deliver(self, event: StreamEvent) -> None:
        record = self._records.get(event.request_id)
        if record is None:
            return
        record.events.put_nowait(event)
        if event.kind in TERMINAL_EVENTS and not record.outcome.done():
            if event.kind == "done":
                record.outcome.set_result(event.data)
            else:  # error / cancelled events carry the exception
                record.outcome.set_exception(event.data)
