"""The job machinery every resource shares: the served models, the engine, the job store and metrics,
and the one typed path a request takes from its HTTP body to its result::

    body -> pick_task -> raw_params -> prepare: Request -> Jobs.submit: engine request id
         -> Jobs.follow: progress, partial outputs, LoopResult

Everything here runs on the event loop; model work runs on the engine's worker thread, so no request
handler ever waits on the model. Each resource (``videos``, ``images``, ``chat``, ``sessions``,
``weights``) adds its jobs to ``Jobs`` in its own module; ``service.Service`` joins them.
"""

from __future__ import annotations

import asyncio
import math
import secrets
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from starlette.datastructures import UploadFile

from fv_core.deploy.card import DeploymentCard, Limits, ModelDeploy
from fv_core.errors import ConfigError, LimitExceeded, QueueFull
from fv_core.loop.contracts import LoopResult, StreamEvent
from fv_core.model import LoadedModel
from fv_core.plugins import PluginHost
from fv_core.request import ImagePart, Part, Request, image_part
from fv_core.runtime import AsyncEngine, Budget, Engine
from fv_core.serving.errors import ApiError
from fv_core.serving.jobs import JobStore
from fv_core.serving.metrics import Metrics
from fv_core.serving.schemas import API_FIELDS, ImageBase, VideoBase

WATCH_S = 0.2  # shared store: how often a replica looks for jobs and weight syncs of other replicas
RECOVER_S = 2.0  # shared store: how often it recovers the jobs of replicas that stopped (or retries a sync)


@dataclass(slots=True)
class ServedModel:
    name: str  # served model name
    deploy: ModelDeploy  # its deploy entry
    loaded: LoadedModel  # card bound to live weights
    created: int  # unix time it was loaded


class Jobs:
    """Models, engine, job store and metrics of one server, and the submission path over them."""

    def __init__(
        self, deploy: DeploymentCard, host: PluginHost, store: JobStore, metrics: Metrics, device: str = "cpu"
    ) -> None:
        self.deploy, self.host, self.store, self.metrics, self.device = deploy, host, store, metrics, device
        self.models: dict[str, ServedModel] = {}
        limits = deploy.limits or Limits()
        budget = Budget(max_running=limits.max_running, max_waiting=limits.max_queue)
        self.engine = AsyncEngine(
            Engine(budget, device=device, scheduling=deploy.scheduling),
            # bitwise: only batch-invariant steps share a call (WorkPlan.invariant_body), so a request's
            # bytes never depend on what it ran with
            batching=True if deploy.determinism == "batched" else "invariant",
            freeze_heap=True,  # models load before the engine starts: their objects leave GC scans
        )
        metrics.watch_engine(self.engine.engine)
        self.draining = False  # shutting down: no new jobs
        self.images_in_flight = 0  # images synchronous requests are waiting for (the autoscaler counts them)
        self._tasks: set[asyncio.Task[None]] = set()  # work that outlives its request (jobs, settles)

    def model(self, name: str | None) -> ServedModel:
        """A served model by name (default: the first deployed); unknown names answer 404."""
        if name is None:
            return next(iter(self.models.values()))
        if name not in self.models:
            raise ApiError(
                404,
                f"model {name!r} is not served here. Available: {sorted(self.models)}. Fix: use one of these.",
                "model_not_found",
                "model",
            )
        return self.models[name]

    def check_taking_jobs(self) -> None:
        """A new job while the server drains answers 503 with Retry-After."""
        if self.draining:
            raise ApiError(
                503,
                "the server is shutting down and takes no new jobs; running jobs finish and stay downloadable. "
                "Fix: retry on another replica, or here after the restart.",
                "shutting_down",
                headers={"Retry-After": str(max(1, math.ceil(self.deploy.shutdown_grace_s)))},
            )

    def spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` in the background; stopping the server waits for it."""
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def submit(self, served: ServedModel, request: Request) -> str:
        """Hand a request to the engine (it answers at once) and return its id; a full queue is 429."""
        try:
            return await self.engine.submit(*served.loaded.job(request))
        except QueueFull as exc:
            self.metrics.refusals.labels("queue_full").inc()
            retry = str(max(1, math.ceil(exc.retry_after_s)))
            raise ApiError(429, str(exc), "queue_full", headers={"Retry-After": retry}) from None
        except ConfigError as exc:
            self.metrics.refusals.labels("invalid").inc()
            raise ApiError(400, str(exc), "invalid_request") from None

    async def submit_when_room(self, served: ServedModel, request: Request) -> str:
        """Submit work already accepted (a later image of a request, a job kept over a restart), waiting
        while the queue is full."""
        while True:
            try:
                return await self.engine.submit(*served.loaded.job(request))
            except QueueFull as exc:
                await asyncio.sleep(min(1.0, max(0.01, exc.retry_after_s)))

    async def follow(
        self,
        rid: str,
        model: str,
        start: float,
        on_progress: Callable[[int], None],
        on_partial: Callable[[object], Awaitable[None]] | None = None,
    ) -> LoopResult:
        """Follow a request to its end, reporting ``on_progress(percent)`` and awaiting
        ``on_partial(data)`` for each partial output; return its result."""
        async for event in self.events(rid, model, start):
            if event.kind == "progress":
                on_progress(min(99, 100 * event.step // event.total) if event.total else 0)
            elif event.kind == "partial" and on_partial is not None:
                await on_partial(event.data)
        return await self.engine.result(rid)

    async def events(self, rid: str, model: str, start: float) -> AsyncGenerator[StreamEvent]:
        """A request's events, counted into the metrics (queue wait, steps, cache stats)."""
        self.metrics.queued.inc()
        started, last_step = False, 0
        try:
            async for event in self.engine.stream(rid):
                if event.kind == "progress":
                    if not started:
                        started = True
                        self.metrics.queued.dec()
                        self.metrics.running.inc()
                        self.metrics.queue_wait.labels(model).observe(time.monotonic() - start)
                    for _ in range(event.step - last_step):
                        self.metrics.step(model)
                    last_step = event.step
                elif event.kind == "done" and isinstance(event.data, LoopResult):
                    self.metrics.cache_stats(model, event.data.metrics)
                    self.metrics.kv_policy_stats(model, event.data.metrics)
                yield event
        finally:
            (self.metrics.running if started else self.metrics.queued).dec()


def pick_task(
    served: ServedModel, asked: str | None, output: str, image: bool = False, text: bool | None = None
) -> str:
    """The task a route runs: the one asked for, else the card's first whose main output is ``output``
    (and that takes an image, when the request sends one; that also outputs text when ``text``, else
    preferably not)."""
    card = served.loaded.card
    programs = card.programs
    fit = [t for t, p in programs.items() if p.outputs[0] == output]
    takes = [t for t in fit if "image" in card.loops[programs[t].stages[0]].accepts]
    preferred = (takes or fit) if image else fit
    writes = [t for t in preferred if "text" in programs[t].outputs]
    if text and asked is None and not writes:
        raise ApiError(
            400,
            f"think=true: model {served.name!r} has no {output} task that also writes its thinking; its "
            f"{output} tasks are {fit}. Fix: drop think, or use a model that thinks (e.g. a BAGEL card).",
            "unsupported_parameter",
            "think",
        )
    preferred = writes if text else ([t for t in preferred if t not in writes] or preferred)
    task = asked if asked is not None else (preferred[0] if preferred else None)
    if task is None or task not in fit:
        raise ApiError(
            400,
            _no_task(served.name, programs, asked, output, fit),
            "unsupported_model" if not fit else "invalid_task",
            "task" if asked is not None else "model",
        )
    return task


ROUTES = {"video": "/v1/videos", "image": "/v1/images/generations", "text": "/v1/chat/completions"}


def _no_task(name: str, programs: dict[str, Any], asked: str | None, output: str, fit: list[str]) -> str:
    """Why model ``name`` runs no ``asked`` task for a route that outputs ``output``: its tasks, what each
    outputs, and the fix."""
    tasks = ", ".join(f"{t} ({p.outputs[0]})" for t, p in programs.items())
    if asked is None or asked not in programs:
        problem = f"model {name!r} has no {output} task" + (f" {asked!r}" if asked is not None else "")
    else:
        problem = f"task {asked!r} of model {name!r} outputs {programs[asked].outputs[0]}, not {output}"
    if fit:
        fix = f"ask for task {' or '.join(repr(t) for t in fit)}, or leave task out"
    else:
        routes = sorted({ROUTES[p.outputs[0]] for p in programs.values() if p.outputs[0] in ROUTES})
        fix = (
            f"ask a model with a {output} task (`fv cards` lists each card's tasks), or this one through "
            + (" or ".join(routes) or "its own route")
        )
    return f"{problem}; its tasks are {tasks}. Fix: {fix}."


def raw_params(body: VideoBase | ImageBase) -> dict[str, Any]:
    """The request params a body sets: its param fields, ``size`` as width/height, a random seed
    when it sets none (omitted params take the card's defaults in ``prepare``)."""
    raw = body.model_dump(exclude=set(API_FIELDS - {"prompt"}), exclude_none=True)
    if body.size is not None and body.size != "auto":
        width, height = (int(v) for v in body.size.split("x"))
        raw.update(width=width, height=height)
    raw.setdefault("seed", secrets.randbelow(2**31))
    return raw


def prepare(
    served: ServedModel,
    raw: dict[str, Any],
    task: str,
    options: dict[str, dict[str, Any]],
    parts: tuple[Part, ...] = (),
    adapters: list[dict[str, Any]] | None = None,
) -> Request:
    """The typed request; bad values, limits, plugin options and adapters answer 400 naming the param."""
    try:
        return served.loaded.prepare(
            raw, task=task, plugin_options=options, parts=parts, adapters=adapters or ()
        )
    except LimitExceeded as exc:
        raise ApiError(400, str(exc), "limit_exceeded", exc.param) from None
    except ConfigError as exc:
        code = "invalid_plugin_options" if exc.param == "plugin_options" else "invalid_request"
        raise ApiError(400, str(exc), code, exc.param) from None


async def upload_bytes(upload: object, param: str) -> bytes:
    """The bytes of an uploaded file; anything else answers 400 naming ``param``."""
    if not isinstance(upload, UploadFile):
        raise ApiError(
            400,
            f"{param} must be an uploaded image file; got {type(upload).__name__}. "
            "Fix: send it as a multipart file field.",
            "unsupported_parameter",
            param,
        )
    return await upload.read()


async def decode_image(data: bytes, param: str) -> tuple[ImagePart, ...]:
    """Image bytes as an image part; an undecodable or oversized image answers 400 naming ``param``."""
    try:
        return (await asyncio.to_thread(image_part, data),)
    except ConfigError as exc:
        raise ApiError(400, f"{param}: {exc}", "invalid_image", param) from None


async def image_parts(upload: object, param: str) -> tuple[ImagePart, ...]:
    """An uploaded image file as an image part; anything else (or an undecodable or oversized image)
    answers 400 naming ``param``."""
    return await decode_image(await upload_bytes(upload, param), param)
