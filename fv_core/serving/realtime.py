"""Real-time sessions: a causal card's video made chunk by chunk at a declared frame rate, steered
while it runs (issue #44). The WebSocket route (``ws.py``) and ``bench/realtime_sessions.py`` drive it.

A real-time session is an open session of the card (``LoadedModel.open_session``) plus a task that
continues it one chunk per request: each chunk runs with the prompt (and strength) in effect when it
is submitted, so steering takes effect at the next chunk boundary, and with seed ``seed + index``, so a
session's frames depend only on what each chunk was asked (the interleave gate replays them).

Deadlines model a player that starts one chunk period (``period_s``: frames per chunk / fps) after the
first chunk arrives, on the next multiple of the period (so sessions of one frame rate make their chunks
at the same instants, and their steps and decodes batch), and then plays ``fps`` frames per second:
chunk i is due when its first frame must show. A chunk is submitted when the one before it starts to play (one chunk of lookahead, so steering
shows within two periods) with that due time as its scheduler deadline (EDF, see
``fv_core.runtime.policy``). A chunk that arrives late is a miss; the player stalls until it arrives.
Achieved fps is frames over the playing time, stalls included. A session generates only while a client
listens; after a pause (no listener, or a paused slow client) the next chunk starts the player again.

Backpressure, per listener: ``drop`` keeps only the newest unsent chunk (older ones are dropped and
counted), ``pause`` stops the session until its client has taken what was sent. A client may also
acknowledge chunks (``window``: chunks sent and not acknowledged at most; 0: no acknowledgements).
Frames are encoded by the listener's sender, so nothing is encoded when nobody listens.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import statistics
import time
import uuid
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from fv_core.errors import ConfigError
from fv_core.model import LoadedModel
from fv_core.runtime import AsyncEngine
from fv_core.runtime.deadlines import ChunkCost, predict_load, refusal

Policy = Literal["drop", "pause"]
LINGER_S = 30.0  # a session without a listener this long is closed (its KV pages return)


@dataclass(slots=True)
class Chunk:
    """One committed chunk and how it was made."""

    index: int  # chunk number in the session
    frames: np.ndarray  # [F, H, W, 3] in 0..1
    first_frame: int  # index of its first frame in the session's video
    prompt: str  # the prompt in effect
    strength: float  # how strongly that prompt applies (1: fully)
    steer_from: str | None  # the prompt it moves away from (strength < 1)
    submitted: float  # monotonic time it was submitted
    done: float  # monotonic time its frames were out
    deadline: float | None  # when its first frame had to show (None: it starts the player)
    recache: bool | None = None  # recache_on_prompt_change as asked (None: the card's default)

    @property
    def latency_s(self) -> float:
        return self.done - self.submitted

    @property
    def missed(self) -> bool:
        return self.deadline is not None and self.done > self.deadline


@dataclass(slots=True)
class Stats:
    """A session's deadline record."""

    chunks: int = 0  # chunks committed
    frames: int = 0  # frames committed
    misses: int = 0  # chunks that arrived after their deadline
    stall_s: float = 0.0  # seconds the player waited for late chunks
    first_frame_s: float | None = None  # first submit to the first chunk's frames
    dropped: int = 0  # chunks a slow client never got (drop policy)
    kv_bytes: int = 0  # KV cache bytes the session holds (its latest chunk's)
    latencies: deque[float] = field(default_factory=lambda: deque(maxlen=512))  # chunk submit -> frames

    def add(self, chunk: Chunk, kv_bytes: int) -> None:
        self.chunks += 1
        self.frames += len(chunk.frames)
        self.latencies.append(chunk.latency_s)
        self.kv_bytes = max(self.kv_bytes, kv_bytes)
        if chunk.missed:
            assert chunk.deadline is not None
            self.misses += 1
            self.stall_s += chunk.done - chunk.deadline

    def achieved_fps(self, fps: float) -> float:
        """Frames over the seconds they played, stalls included (0 before any frame)."""
        return self.frames / (self.frames / fps + self.stall_s) if self.frames else 0.0

    def as_dict(self, fps: float) -> dict[str, Any]:
        lat = sorted(self.latencies)
        return {
            "chunks": self.chunks, "frames": self.frames, "deadline_misses": self.misses,
            "stall_s": self.stall_s, "achieved_fps": self.achieved_fps(fps), "first_frame_s": self.first_frame_s,
            "chunk_latency_s": {"median": statistics.median(lat), "p95": lat[int(0.95 * (len(lat) - 1))]}
            if lat else None,
            "dropped_chunks": self.dropped, "kv_bytes": self.kv_bytes,
        }  # fmt: skip


class Listener:
    """One connected client's outbox, under its backpressure policy."""

    def __init__(self, policy: Policy = "drop", window: int = 0) -> None:
        self.policy, self.window = policy, window
        self.outbox: deque[Chunk] = deque()  # committed chunks not yet sent
        self.unacked = 0  # chunks sent and not acknowledged (window > 0)
        self.dropped = 0  # chunks replaced by a newer one before they were sent
        self.changed = asyncio.Event()
        self.ended = False  # the session ended (or another client took it over)
        self.finished = asyncio.Event()  # its sender sent the end and closed the socket

    def offer(self, chunk: Chunk) -> None:
        if self.policy == "drop":
            self.dropped += len(self.outbox)
            self.outbox.clear()
        self.outbox.append(chunk)
        self.changed.set()

    def _open(self) -> bool:
        return self.window == 0 or self.unacked < self.window

    def caught_up(self) -> bool:
        """It took everything sent (the pause policy's condition to go on)."""
        return not self.outbox and self._open()

    async def next(self) -> Chunk | None:
        """The next chunk to send (waits for one, and for an acknowledgement when the window is full);
        None once the session ended and everything was sent."""
        while not (self.outbox and self._open()):
            if self.ended:
                return None
            self.changed.clear()
            await self.changed.wait()
        self.unacked += self.window > 0
        self.changed.set()  # the session may wait for caught_up
        return self.outbox.popleft()

    def ack(self) -> None:
        self.unacked = max(0, self.unacked - 1)
        self.changed.set()


class RealtimeSession:
    """One session's chunk task over the engine."""

    def __init__(
        self, sid: str, model: str, loaded: LoadedModel, engine: AsyncEngine, fps: float, params: dict[str, Any],
        linger_s: float = LINGER_S, on_chunk: Any = None,
    ) -> None:  # fmt: skip
        self.id, self.model, self.loaded, self.engine, self.fps = sid, model, loaded, engine, fps
        self.params = dict(params)  # the request params of every chunk (prompt, size, ...)
        self.seed = int(self.params.pop("seed", 0))  # chunk i runs with seed + i
        self.strength = 1.0
        self.linger_s = linger_s
        self.on_chunk = on_chunk  # on_chunk(session, chunk, alone): a chunk was committed
        self.on_end: Any = None  # on_end(session): it ended (its pages returned)
        defaults = loaded.program(None)[1].defaults
        self.chunk_frames = int(self.params.get("chunk_frames") or defaults.get("chunk_frames", 1))
        self.steps = int(self.params.get("num_inference_steps") or defaults.get("num_inference_steps", 4))
        self.frames_per_chunk = 4 * self.chunk_frames  # frames a chunk decodes to (the first chunk: 3 fewer)
        self.stats = Stats()
        self.last: Chunk | None = None  # the last committed chunk (what a reconnect gets first)
        self.listener: Listener | None = None
        self.closed: str | None = None  # why it ended
        self.close_code = 1000  # the WebSocket close code its listener gets (1001: the server is going away)
        self.changed = asyncio.Event()  # a listener came or went, a steer, a close
        self._task: asyncio.Task[None] | None = None
        self._rid: str | None = None  # the chunk request in flight
        self._previous = str(self.params.get("prompt", ""))  # the prompt a steer with strength < 1 leaves

    @property
    def period_s(self) -> float:
        """Seconds a chunk plays: its deadline period."""
        return self.frames_per_chunk / self.fps

    @property
    def prompt(self) -> str:
        return str(self.params.get("prompt", ""))

    def steer(
        self, prompt: str | None = None, strength: float | None = None, recache: bool | None = None
    ) -> None:
        """A new prompt and/or strength (0 < strength <= 1: the share of the new prompt against the one
        before it) for the next chunk to be submitted; ``recache``: whether a chunk under a new prompt first
        re-caches the session's window under it (``recache_on_prompt_change``, from now on)."""
        if prompt is not None and (not isinstance(prompt, str) or not prompt.strip()):
            raise ConfigError(
                f'prompt={prompt!r}: a steer\'s prompt is a non-empty string. Fix: e.g. "a blue square"',
                param="prompt",
            )
        if strength is not None and (not isinstance(strength, int | float) or not 0 < strength <= 1):
            raise ConfigError(
                f"strength={strength}: the share of the new prompt is 0 < strength <= 1. Fix: e.g. 0.5",
                param="strength",
            )
        if recache is not None and not isinstance(recache, bool):
            raise ConfigError(
                f"recache={recache!r}: whether a new prompt re-caches the session's window is true or false. "
                "Fix: e.g. recache=true",
                param="recache",
            )
        if recache is not None:
            self.params["recache_on_prompt_change"] = recache
        if prompt is not None and prompt != self.prompt:
            self._previous, self.params["prompt"] = self.prompt, prompt
        if strength is not None:
            self.strength = float(strength)

    def chunk_params(self, index: int) -> dict[str, Any]:
        """The params of chunk ``index`` as steered now (what a replay of the session sends)."""
        raw = {**self.params, "seed": self.seed + index, "session_id": self.id}
        raw["num_frames"] = 4 * (self.chunk_frames - 1) + 1  # one chunk of latent frames
        if self.strength < 1.0:
            raw.update(steer_from=self._previous, steer_strength=self.strength)
        return raw

    def start(self) -> None:
        """Start the chunk task: it makes chunks while a client listens, and ends the session after
        ``linger_s`` without one."""
        self._task = asyncio.create_task(self._run())

    def attach(self, listener: Listener) -> None:
        """A client listens (replacing an earlier one); the session generates while it does."""
        if self.listener is not None:
            self.listener.ended = True
            self.listener.changed.set()
        self.listener = listener
        self.changed.set()

    def detach(self, listener: Listener) -> None:
        if self.listener is listener:
            self.listener = None
            self.changed.set()

    async def close(self, reason: str, code: int = 1000) -> None:
        """End the session: its chunk in flight is cancelled, its pages return; its listener gets the
        reason and the WebSocket close ``code``."""
        if self.closed is None:
            self.closed, self.close_code = reason, code
        self.changed.set()
        if self._rid is not None:
            self.engine.cancel(self._rid, reason)
        task = self._task
        if task is not None and task is not asyncio.current_task():
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._end()

    def _end(self) -> None:
        """Return the session's pages, tell its listener and its owner."""
        self.loaded.close_session(self.id)
        if self.listener is not None:
            self.listener.ended = True
            self.listener.changed.set()
        if self.on_end is not None:
            self.on_end(self)
            self.on_end = None

    # -- the chunk task -------------------------------------------------------------------------------

    async def _run(self) -> None:
        index, due = 0, None  # the next chunk; when its first frame must show (None: it starts the player)
        try:
            while self.closed is None:
                if due is not None:  # one chunk of lookahead: submitted a period before it is due
                    await self._sleep_until(due - self.period_s)
                ready, waited = await self._wait_for_room()
                if not ready:
                    break
                chunk = await self._make(index, time.monotonic(), None if waited else due)
                start = (
                    self._aligned(chunk.done) if chunk.deadline is None else max(chunk.done, chunk.deadline)
                )
                due, index = start + len(chunk.frames) / self.fps, index + 1
        except Exception as exc:  # the chunk failed (closed session, engine stopped): the session ends
            self.closed = self.closed or f"{type(exc).__name__}: {exc}"
        finally:
            self._end()

    def _aligned(self, done: float) -> float:
        """When the player starts after a chunk that starts it: a period after ``done``, pushed on to the
        next multiple of the period on the monotonic clock, so sessions of one frame rate submit their
        chunks at the same instants and their steps batch (a later start by less than a period)."""
        return math.ceil((done + self.period_s) / self.period_s) * self.period_s

    def _paused(self) -> bool:
        """No one listens, or a pausing client has not taken what it was sent."""
        listener = self.listener
        return listener is None or (listener.policy == "pause" and not listener.caught_up())

    async def _wait_for_room(self) -> tuple[bool, bool]:
        """Until a listener is ready for more: (False when the session closed or lingered too long
        without a client, whether it had to wait: the player starts again)."""
        lingering, waited = None, False
        while self.closed is None and self._paused():
            waited = True
            if self.listener is None:
                lingering = lingering or time.monotonic()
                if time.monotonic() - lingering >= self.linger_s:
                    self.closed = f"no client for {self.linger_s:g} s"
                    break
            waits = [asyncio.ensure_future(self.changed.wait())]
            if self.listener is not None:
                waits.append(asyncio.ensure_future(self.listener.changed.wait()))
                self.listener.changed.clear()
            self.changed.clear()
            _, pending = await asyncio.wait(waits, timeout=self.linger_s, return_when=asyncio.FIRST_COMPLETED)
            for w in pending:
                w.cancel()
        return self.closed is None, waited

    async def _sleep_until(self, at: float) -> None:
        """Until ``at``, or sooner when the session closes."""
        while self.closed is None and (left := at - time.monotonic()) > 0:
            self.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), left)

    async def _make(self, index: int, now: float, deadline: float | None) -> Chunk:
        """Submit chunk ``index`` with its deadline (or, starting the player, a period from now) and
        commit it: stats, the last chunk, the listener's outbox."""
        raw = self.chunk_params(index)
        rid = f"{self.id}-{index}-{uuid.uuid4().hex[:6]}"
        request = self.loaded.prepare(raw, request_id=rid)
        self._rid = await self.engine.submit(
            *self.loaded.job(request), deadline=deadline if deadline is not None else now + self.period_s
        )
        alone = self.engine.in_flight == 1
        try:
            result = await self.engine.result(self._rid)
        finally:
            self._rid = None
        alone = alone and self.engine.in_flight == 0
        frames = result.outputs["frames"].float().cpu().numpy()
        first = self.last.first_frame + len(self.last.frames) if self.last else 0
        strength, steer_from = float(raw.get("steer_strength", 1.0)), raw.get("steer_from")
        chunk = Chunk(
            index, frames, first, str(raw["prompt"]), strength, steer_from, now, time.monotonic(), deadline,
            raw.get("recache_on_prompt_change"),
        )  # fmt: skip
        if self.stats.first_frame_s is None:
            self.stats.first_frame_s = chunk.latency_s
        self.stats.add(chunk, int(result.metrics.get("kv_bytes", 0)))
        self.last = chunk
        if self.listener is not None:
            self.listener.offer(chunk)
            self.stats.dropped = self.listener.dropped
        if self.on_chunk is not None:
            self.on_chunk(self, chunk, alone)
        return chunk

    def record(self) -> dict[str, Any]:
        """The session record (``GET /v1/sessions/{id}``)."""
        return {
            "id": self.id, "object": "session", "model": self.model, "fps": self.fps, "prompt": self.prompt,
            "strength": self.strength, "period_s": self.period_s, "listening": self.listener is not None,
            "closed": self.closed, **self.stats.as_dict(self.fps),
        }  # fmt: skip


class RealtimeSessions:
    """The real-time sessions of one server, their admission and the chunk cost it predicts from."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.sessions: dict[str, RealtimeSession] = {}
        self.solo_s: dict[str, float] = {}  # model -> EMA of a chunk made alone

    def get(self, sid: str) -> RealtimeSession | None:
        return self.sessions.get(sid)

    def cost(self, model: str, loaded: LoadedModel, steps: int) -> ChunkCost | None:
        """The measured chunk cost of ``model`` (None before a chunk ran alone)."""
        solo = self.solo_s.get(model)
        if solo is None:
            return None
        loop_id = loaded.program(None)[1].stages[0]

        def measured(kind: str) -> Any:  # the most measured batch curve of the loop's units of kind
            curves = [
                c for k, c in self.engine.engine.cost.curves().items()
                if isinstance(k, tuple) and k[0] == loop_id and k[1] == kind and c.seconds
            ]  # fmt: skip
            return max(curves, key=lambda c: len(c.seconds)) if curves else None

        curve, decode = measured("diffusion_step"), measured("vae_tile")
        if not self.engine.batching or curve is None:
            return ChunkCost(solo)
        share = (steps + 1) * (curve.predict(1) or 0.0) / solo  # the denoise steps and the cache write
        if decode is None:
            return ChunkCost(solo, share, curve.predict)
        return ChunkCost(solo, share, curve.predict, (decode.predict(1) or 0.0) / solo, decode.predict)

    def admit(self, session: RealtimeSession) -> dict[str, Any] | None:
        """Hold ``session`` if the instance meets its deadlines and those of the sessions it holds: the
        predicted load (None: no chunk measured yet, admitted); else ConfigError with the numbers."""
        cost = self.cost(session.model, session.loaded, session.steps)
        held = [s for s in self.sessions.values() if s.model == session.model and s.closed is None]
        load = None
        if cost is not None:
            load = predict_load([s.period_s for s in held] + [session.period_s], cost)
            if not load.fits:
                raise ConfigError(refusal(load, session.fps, session.frames_per_chunk, cost), param="fps")
        session.on_chunk = self._measured
        session.on_end = lambda s: self.sessions.pop(s.id, None)
        self.sessions[session.id] = session
        session.start()
        return load.as_dict() if load is not None else None

    def _measured(self, session: RealtimeSession, chunk: Chunk, alone: bool) -> None:
        """Learn the solo chunk cost from chunks that ran with nothing else in flight (past the first,
        which encodes the prompt)."""
        if not alone or chunk.index == 0:
            return
        old = self.solo_s.get(session.model)
        self.solo_s[session.model] = chunk.latency_s if old is None else 0.7 * old + 0.3 * chunk.latency_s

    async def close(self, sid: str, reason: str, code: int = 1000) -> bool:
        session = self.sessions.pop(sid, None)
        if session is None:
            return False
        await session.close(reason, code)
        return True

    async def close_all(self, reason: str, code: int = 1001, timeout_s: float = 5.0) -> None:
        """End every session (a server shutting down): each listener gets the end with ``reason`` and the
        close ``code`` (waited for up to ``timeout_s``), and every session's pages return."""
        listeners = [s.listener for s in self.sessions.values() if s.listener is not None]
        for sid in list(self.sessions):
            await self.close(sid, reason, code)
        if listeners:
            await asyncio.wait(
                [asyncio.ensure_future(x.finished.wait()) for x in listeners], timeout=timeout_s
            )


class RealtimeCollector:
    """``/metrics``: each real-time session's deadline misses, achieved fps and chunk latency (p95), and
    the sessions held per model (read at each scrape)."""

    def __init__(self, sessions: RealtimeSessions) -> None:
        self.sessions = sessions

    def collect(self) -> Iterator[Metric]:
        held = GaugeMetricFamily("fv_realtime_sessions", "Real-time sessions held", labels=["model"])
        misses = CounterMetricFamily(
            "fv_realtime_deadline_misses",
            "Chunks that missed their deadline, per session",
            labels=["session", "model"],
        )
        fps = GaugeMetricFamily("fv_realtime_achieved_fps", "Frames per second played, stalls included",
                                labels=["session", "model"])  # fmt: skip
        p95 = GaugeMetricFamily(
            "fv_realtime_chunk_latency_p95_seconds",
            "Chunk submit to frames, p95",
            labels=["session", "model"],
        )
        count: dict[str, int] = {}
        for s in list(self.sessions.sessions.values()):
            count[s.model] = count.get(s.model, 0) + 1
            record = s.stats.as_dict(s.fps)
            misses.add_metric([s.id, s.model], s.stats.misses)
            fps.add_metric([s.id, s.model], record["achieved_fps"])
            if record["chunk_latency_s"] is not None:
                p95.add_metric([s.id, s.model], record["chunk_latency_s"]["p95"])
        for model, n in count.items():
            held.add_metric([model], n)
        yield from (held, misses, fps, p95)
