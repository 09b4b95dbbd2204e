"""The serving glue: deployed models on one AsyncEngine, jobs followed step by step.

Everything here runs on the event loop; model work runs on the engine's
worker thread and mp4 / PNG encoding in ``asyncio.to_thread``, so no request
handler ever waits on the model.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import logging
import math
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from pydantic import ValidationError

from fv_core.artifacts import VideoArtifact, to_uint8
from fv_core.deploy.card import DeploymentCard, Limits, ModelDeploy
from fv_core.errors import (
    AdmissionInfeasible,
    Cancelled,
    ConfigError,
    LimitExceeded,
    QueueFull,
    WeightsError,
    explain,
)
from fv_core.load import load
from fv_core.loop.contracts import LoopResult, StreamEvent
from fv_core.model import LoadedModel
from fv_core.plugins import PluginHost
from fv_core.request import ImagePart, Request, image_part
from fv_core.request.params import MAX_SEED
from fv_core.runtime import AsyncEngine, Budget, Engine
from fv_core.serving.chat import conversation
from fv_core.serving.chat import params as chat_params
from fv_core.serving.jobs import JobStore, new_job_id
from fv_core.serving.metrics import Metrics
from fv_core.serving.schemas import (
    API_FIELDS,
    ChatCompletionCreate,
    ImageBase,
    Video,
    VideoBase,
    WeightsSynced,
)
from fv_core.serving.stream import VideoChunks
from fv_core.serving.weight_log import WeightLog, tensor_names

if TYPE_CHECKING:
    from fv_core.training.sync import SyncResult

log = logging.getLogger("fv.serving")
WATCH_S = 0.2  # shared store: how often a replica looks for its jobs deleted through another replica
RECOVER_S = 5.0  # shared store: how often it recovers the jobs of replicas that stopped
FLEET_SYNC_WAIT_S = 30.0  # a fleet's weight sync answers once every replica applied it, or after this


class ApiError(Exception):
    """An HTTP error answered as OpenAI's ``{"error": {...}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.headers = headers or {}


@dataclass(slots=True)
class ServedModel:
    name: str  # served model name
    deploy: ModelDeploy  # its deploy entry
    loaded: LoadedModel  # card bound to live weights
    created: int  # unix time it was loaded


class Service:
    """Models, engine, job store and metrics of one server."""

    def __init__(
        self, deploy: DeploymentCard, host: PluginHost, store: JobStore, metrics: Metrics, device: str = "cpu"
    ) -> None:
        self.deploy, self.host, self.store, self.metrics, self.device = deploy, host, store, metrics, device
        self.models: dict[str, ServedModel] = {}
        limits = deploy.limits or Limits()
        budget = Budget(max_running=limits.max_running, max_waiting=limits.max_queue)
        self.engine = AsyncEngine(
            Engine(budget, device=device),
            batching=deploy.determinism == "batched",
            freeze_heap=True,  # models load before the engine starts: their objects leave GC scans
        )
        self.live: dict[str, str] = {}  # job id -> engine request id, while running
        self.streams: dict[str, VideoChunks] = {}  # job id -> the chunks it streamed, while running
        self._tasks: set[asyncio.Task] = set()
        self._watcher: asyncio.Task | None = None  # shared store only: see _watch
        self.draining = False  # shutting down: no new jobs
        self._sync_lock = asyncio.Lock()  # one weight sync at a time (each stages on the live weights)
        self._weights = WeightLog(store) if store.shared else None  # a fleet's weight syncs
        self._weights_seq = 0  # the last of them this replica applied

    # -- lifecycle ------------------------------------------------------------------------------------

    async def start(self) -> None:
        self.models = await asyncio.to_thread(self._load_models)
        self.sweep()
        await self.engine.start()
        if self._weights is not None:  # a fleet replica takes jobs on the fleet's weights
            for name, served in self.models.items():  # pushes from now on wait for this replica too
                self._weights.applied(name, 0)
                self._weights.taken(name, served.loaded.instance.weights_versions)  # never a push's
            async with self._sync_lock:
                await self._catch_up()
        self._start_requeue()
        if self.store.shared:
            self._watcher = asyncio.create_task(self._watch())

    @property
    def queue_depth(self) -> int:
        """Video jobs this server has accepted and not finished (queued or running)."""
        return len(self.live)

    def sweep(self) -> None:
        """Apply the deployment's retention (expired jobs, then the disk cap)."""
        self.store.sweep(self.deploy.retention.max_bytes)

    async def drain(self) -> None:
        """Stop taking jobs (new ones answer 503) and give in-flight ones the deploy's grace period."""
        self.draining = True
        if self._tasks and self.deploy.shutdown_grace_s > 0:
            await asyncio.wait(self._tasks, timeout=self.deploy.shutdown_grace_s)

    async def stop(self) -> None:
        """Drain (unless a drain ran already), stop the engine (the jobs left fail with the reason) and let
        the job tasks record it."""
        if not self.draining:
            await self.drain()
        if self._watcher is not None:
            self._watcher.cancel()
        await self.engine.stop()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=30)
        for served in self.models.values():
            served.loaded.close()  # a parallel model's worker processes exit

    def _load_models(self) -> dict[str, ServedModel]:
        """Every deployed model, loaded as ``fv_core.load(name, deploy=...)`` loads it."""
        now = int(time.time())
        return {
            m.served_name: ServedModel(
                m.served_name,
                m,
                load(m.served_name, deploy=self.deploy, device=self.device, host=self.host),
                now,
            )
            for m in self.deploy.models
        }

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

    def _check_taking_jobs(self) -> None:
        """A new job while the server drains answers 503 with Retry-After."""
        if self.draining:
            raise ApiError(
                503,
                "the server is shutting down and takes no new jobs; running jobs finish and stay downloadable. "
                "Fix: retry on another replica, or here after the restart.",
                "shutting_down",
                headers={"Retry-After": str(max(1, math.ceil(self.deploy.shutdown_grace_s)))},
            )

    # -- videos ---------------------------------------------------------------------------------------

    async def create_video(self, body: VideoBase, request_id: str | None = None) -> Video:
        self._check_taking_jobs()
        served = self.model(body.model)
        task = self._task(served, body.task, "video", image=body.input_reference is not None)
        program = served.loaded.card.programs[task]
        parts = await self._reference(served, task, body.input_reference)
        raw = self._raw(body)
        if body.seconds is not None and "num_frames" not in raw:
            raw["num_frames"] = round(body.seconds * raw.get("fps", program.defaults.get("fps", 16))) + 1
        request = self._prepare(served, raw, task, body.plugin_options, parts)
        rid = await self._submit(*served.loaded.job(request))
        job_id = new_job_id()
        p = request.params
        size = f"{p.width}x{p.height}" if hasattr(p, "width") else "auto"
        seconds = f"{p.num_frames / p.fps:g}" if hasattr(p, "num_frames") and hasattr(p, "fps") else "auto"
        kept = None if parts else {"raw": raw, "task": task, "plugin_options": body.plugin_options}
        video = self.store.create(job_id, served.name, size, seconds, body.prompt, kept, request_id)
        log.info("job %s created by request %s", job_id, request_id)
        self.metrics.requests.labels(served.name, "video").inc()
        self._follow_video(job_id, rid, served, request)
        return video

    def _follow_video(self, job_id: str, rid: str, served: ServedModel, request: Request) -> None:
        self.live[job_id] = rid
        self.streams[job_id] = VideoChunks()
        task = asyncio.create_task(self._run_video(job_id, rid, served, request))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _start_requeue(self) -> None:
        requeue = asyncio.create_task(self._requeue())
        self._tasks.add(requeue)
        requeue.add_done_callback(self._tasks.discard)

    async def _watch(self) -> None:
        """Shared store: cancel (at the next step boundary) the jobs running here that were deleted
        through another replica, apply the weight syncs other replicas received, and now and then take
        over the jobs of replicas that stopped."""
        last_recovery, cancelled = time.monotonic(), set[str]()
        weights_retry = 0.0  # after a sync failed here, when to try it again
        while True:
            await asyncio.sleep(WATCH_S)
            if (
                self._weights is not None
                and time.monotonic() >= weights_retry
                and not self._sync_lock.locked()
            ):
                try:
                    async with self._sync_lock:
                        await self._catch_up()
                except Exception:  # recorded for the pusher; later syncs wait behind it
                    log.exception("applying the fleet's weight sync after %d failed", self._weights_seq)
                    weights_retry = time.monotonic() + RECOVER_S
            try:
                cancelled &= set(self.live)
                for job_id in set(self.store.missing(list(self.live))) - cancelled:
                    rid = self.live.get(job_id)
                    if rid is not None:
                        self.engine.cancel(rid, "the video was deleted")
                        cancelled.add(job_id)
                if not self.draining and time.monotonic() - last_recovery >= RECOVER_S:
                    last_recovery = time.monotonic()
                    if self.store.recover():
                        log.warning("failed the running jobs of a replica that stopped")
                    self._start_requeue()
            except Exception:  # a busy database: try again next round
                log.exception("watching the shared job store failed")

    async def _requeue(self) -> None:
        """Run again the queued jobs a stopped server kept (the same request and seed)."""
        for job_id, model, kept in self.store.claim_queued(list(self.models)):
            try:
                served = self.model(model)
                request = self._prepare(served, kept["raw"], kept["task"], kept["plugin_options"])
            except ApiError as exc:  # the deployment changed meanwhile
                self.store.fail(
                    job_id, "server_restart", f"after the restart this job cannot run: {exc.message}"
                )
                continue
            rid = await self._submit_when_room(served.loaded.job(request))
            self._follow_video(job_id, rid, served, request)

    async def _run_video(self, job_id: str, rid: str, served: ServedModel, request: Request) -> None:
        """Follow the job, then save its artifact (the mp4, with sound when the task makes it, and the
        provenance JSON beside it) the way ``fv generate`` saves it."""
        model, start, status = served.name, time.monotonic(), "failed"
        try:
            chunks = self.streams[job_id]

            async def chunk(partial: Any) -> None:  # a streaming loop's new frames
                if isinstance(partial, dict) and "frames" in partial:
                    await chunks.add(partial["frames"].float().cpu().numpy())

            result = await self._follow(rid, model, start, lambda p: self.store.progress(job_id, p), chunk)
            artifact = served.loaded.artifact(request, result, time.monotonic() - start)
            assert isinstance(artifact, VideoArtifact), "create_video runs tasks that output video"
            path = self.store.video_path(job_id)
            await asyncio.to_thread(save_atomically, artifact, path)
            count, height, width = artifact.frames.shape[:3]
            if self.store.complete(job_id, f"{width}x{height}", f"{count / artifact.fps:g}"):
                status = "completed"
            else:  # deleted while the files were written
                path.unlink(missing_ok=True)
                path.with_suffix(".json").unlink(missing_ok=True)
                status = "cancelled"
        except Cancelled as exc:
            if self.draining and self.store.is_requeueable(job_id):
                status = "requeued"  # it never started: the next server runs it
            else:
                self.store.fail(job_id, "cancelled", str(exc))  # a no-op when the job was deleted
                status = "cancelled"
        except AdmissionInfeasible as exc:  # refused by the engine after the job was created
            self.metrics.refusals.labels("infeasible").inc()
            self.store.fail(job_id, "admission_infeasible", str(exc))
        except Exception as exc:  # the job fails with the reason; the server keeps serving
            log.exception("job %s (request %s) failed", job_id, self.store.request_id(job_id))
            self.store.fail(job_id, "generation_failed", f"{type(exc).__name__}: {exc}")
        finally:
            self.live.pop(job_id, None)
            await self.streams.pop(job_id).end()  # its subscribers read what is left, then the job
            self.sweep()
            self.metrics.jobs.labels(model, status).inc()
            self.metrics.latency.labels(model, status).observe(time.monotonic() - start)

    def delete(self, job_id: str) -> bool:
        """Delete a job and its file; a running one is cancelled at its next step boundary."""
        rid = self.live.get(job_id)
        if rid is not None:
            self.engine.cancel(rid, "the video was deleted")
        return self.store.delete(job_id)

    # -- images ---------------------------------------------------------------------------------------

    async def generate_images(self, body: ImageBase, parts: tuple[ImagePart, ...] = ()) -> list[Image]:
        """``n`` images as base64 PNGs, each with the text made with it (``think``: the thinking); waits
        for them (like OpenAI's images API). ``parts``: the image to edit."""
        self._check_taking_jobs()
        served = self.model(body.model)
        raw = self._raw(body)
        think = raw.pop("think", None)
        task = self._task(served, body.task, "image", image=bool(parts), text=think)
        if parts and "width" in raw and "width" not in served.loaded.params_model(task).model_fields:
            raise ApiError(
                400,
                f"size={body.size!r}: task {task!r} takes its size from the image. Fix: drop size (or send auto).",
                "invalid_request",
                "size",
            )
        seed = raw.pop("seed")
        requests = [
            self._prepare(served, {**raw, "seed": (seed + i) % MAX_SEED}, task, body.plugin_options, parts)
            for i in range(body.n)
        ]
        first = await self._submit(*served.loaded.job(requests[0]))  # a full queue refuses the request
        self.metrics.requests.labels(served.name, "image").inc()
        window = asyncio.Semaphore((self.deploy.limits or Limits()).max_running)

        async def one(index: int, request: Request) -> Image:
            async with window:  # an n-image request holds at most max_running places, so others get in
                rid = first if index == 0 else await self._submit_when_room(served.loaded.job(request))
                return await self._image(rid, served.name)

        return list(await asyncio.gather(*(one(i, r) for i, r in enumerate(requests))))

    async def _image(self, rid: str, model: str) -> Image:
        start, status = time.monotonic(), "failed"
        try:
            result = await self._follow(rid, model, start, lambda p: None)
            png = await asyncio.to_thread(encode_png, result.outputs["frames"][0].float().numpy())
            status = "completed"
            text = result.outputs.get("text")
            return Image(base64.b64encode(png).decode(), None if text is None else str(text))
        except Exception as exc:
            raise failure(exc, "image generation", self.metrics) from None
        finally:
            self.metrics.jobs.labels(model, status).inc()
            self.metrics.latency.labels(model, status).observe(time.monotonic() - start)

    # -- chat -----------------------------------------------------------------------------------------

    async def chat(self, body: ChatCompletionCreate) -> tuple[str, str]:
        """Queue a chat completion; returns (served model name, engine request id)."""
        self._check_taking_jobs()
        served = self.model(body.model)
        task = self._task(served, None, "text")
        try:
            parts, prompt = await asyncio.to_thread(conversation, body.messages)  # decodes the images
        except ConfigError as exc:
            raise ApiError(400, str(exc), "invalid_request", exc.param) from None
        raw = {**chat_params(body), "prompt": prompt}
        raw.setdefault("seed", secrets.randbelow(2**31))
        request = self._prepare(served, raw, task, body.plugin_options, tuple(parts))
        rid = await self._submit(*served.loaded.job(request))
        self.metrics.requests.labels(served.name, "chat").inc()
        return served.name, rid

    async def chat_text(self, rid: str, model: str) -> AsyncIterator[str | dict[str, Any]]:
        """A chat's text deltas as they are made, then its result's metrics. A failure before the first
        token raises the ApiError (so the answer is a 4xx, not a broken stream); closing the iterator
        early (the client left) cancels the request at its next step."""
        start, status, ended = time.monotonic(), "failed", False
        events = self._events(rid, model, start)
        try:
            async for event in events:
                if event.kind == "partial":
                    yield event.data["delta"]
            ended = True
            result = await self.engine.result(rid)
            status = "completed"
            yield result.metrics
        except Exception as exc:
            raise failure(exc, "chat completion", self.metrics) from None
        finally:
            await events.aclose()
            if not ended:  # the client went away mid-stream
                status = "cancelled"
                self.engine.cancel(rid, "the client went away")
                settle = asyncio.create_task(self._settle(rid))
                self._tasks.add(settle)
                settle.add_done_callback(self._tasks.discard)
            self.metrics.jobs.labels(model, status).inc()
            self.metrics.latency.labels(model, status).observe(time.monotonic() - start)

    async def _settle(self, rid: str) -> None:
        """Collect an abandoned request's outcome so the engine forgets it."""
        with contextlib.suppress(Exception):
            await self.engine.result(rid)

    async def _submit_when_room(self, job: tuple[Any, Any, Any]) -> str:
        """Submit work already accepted (a later image of a request, a job kept over a restart), waiting
        while the queue is full."""
        while True:
            try:
                return await self.engine.submit(*job)
            except QueueFull as exc:
                await asyncio.sleep(min(1.0, max(0.01, exc.retry_after_s)))

    # -- sessions -------------------------------------------------------------------------------------

    def open_session(self, model: str | None, ttl_s: float | None) -> tuple[str, str]:
        """(served model name, the new session's id); a model without sessions is a 400."""
        served = self.model(model)
        try:
            return served.name, served.loaded.open_session(ttl_s)
        except ConfigError as exc:
            raise ApiError(400, str(exc), "unsupported_model" if exc.param is None else "invalid_request",
                           exc.param or "model") from None  # fmt: skip

    def close_session(self, session_id: str) -> None:
        """Close a session on whichever served model holds it; unknown ids are a 404."""
        if not any(served.loaded.close_session(session_id) for served in self.models.values()):
            raise ApiError(
                404,
                f"no open session {session_id[:80]!r} (closed, expired or never opened). Fix: open one with "
                "POST /v1/sessions.",
                "session_not_found",
                "session_id",
            )

    # -- weight sync ----------------------------------------------------------------------------------

    async def sync_weights(self, model: str | None, plan_json: str, weights: bytes) -> WeightsSynced:
        """Put a trainer's weights live (``fv_core.training.sync``): checked and staged off the engine's
        thread while generation goes on, swapped in between two of its ticks. Jobs accepted before
        finish on the weights they started with; bad plans and tensors answer 400, version clashes
        409, and change nothing. A fleet replica puts it live on every replica (``weight_log``) and
        answers once they all applied it, or after ``FLEET_SYNC_WAIT_S``."""
        from fv_core.training.sync import WeightSyncPlan

        served = self.model(model)
        try:
            plan = WeightSyncPlan.model_validate_json(plan_json)
        except ValidationError as exc:
            message = explain(exc, "weight sync plan", WeightSyncPlan.model_fields)
            raise ApiError(400, message, "invalid_plan", "plan") from None
        work = asyncio.ensure_future(self._sync(served, plan, weights))
        try:
            result, seq = await asyncio.shield(work)  # a caller that goes away never stops a swap midway
        except asyncio.CancelledError:
            work.add_done_callback(_log_unheard)
            raise
        except WeightsError as exc:
            raise ApiError(400, str(exc), "invalid_weights", "weights") from None
        except ConfigError as exc:
            if exc.param == "version":
                raise ApiError(409, str(exc), "version_conflict", "plan") from None
            raise ApiError(400, str(exc), "invalid_plan", "plan") from None
        log.info(
            "weights of %s synced: %s (role %s; %d cache entries dropped; %d requests finish on the previous)",
            served.name, result.versions, result.role, result.cache_entries_dropped, len(result.pinned),
        )  # fmt: skip
        fleet = {}
        if self._weights is not None:
            fleet = await self._fleet_caught_up(served.name, seq)
            try:
                self._weights.compact(served.name)
            except Exception:  # the log stays longer; the next push compacts it
                log.exception("compacting the fleet's weight log failed")
        return WeightsSynced(
            model=served.name,
            role=result.role,
            versions=result.versions,
            previous=result.previous,
            tensors=result.tensors,
            cache_entries_dropped=result.cache_entries_dropped,
            requests_on_previous=len(result.pinned),
            **fleet,
        )

    async def _sync(self, served: ServedModel, plan: Any, weights: bytes) -> tuple[SyncResult, int]:
        """A push, one at a time: (what it did, its seq in a fleet's log; 0 on a lone server)."""
        async with self._sync_lock:
            if self._weights is None:
                return await self._apply(served, plan, weights), 0
            async with self._weights.lock():
                return await self._fleet_push(served, plan, weights)

    async def _apply(self, served: ServedModel, plan: Any, weights: bytes) -> SyncResult:
        """Stage ``weights`` off the engine's thread, then swap them in at its next step boundary."""
        from fv_core.training.sync import stage_sync

        staged = await asyncio.to_thread(stage_sync, served.loaded, plan, weights)
        return await asyncio.wrap_future(self.engine.at_boundary(staged.apply))

    async def _fleet_push(self, served: ServedModel, plan: Any, weights: bytes) -> tuple[SyncResult, int]:
        """A push this fleet replica received (under the fleet's sync lock): on the fleet's weights,
        checked, logged pending, put live here, then settled for the others."""
        from fv_core.training.sync import stage_sync

        assert self._weights is not None
        try:
            await self._catch_up()
        except Exception as exc:
            raise ApiError(
                503,
                f"this replica cannot apply the fleet's earlier weight syncs ({exc}), so it cannot check "
                "this one against the fleet's weights. Fix: push again (through another replica).",
                "replica_behind",
            ) from None
        self._weights.check_new(served.name, plan.components, plan.version)
        staged = await asyncio.to_thread(stage_sync, served.loaded, plan, weights)  # 400 / 409 here
        path = await asyncio.to_thread(self._weights.write, weights)
        sync = self._weights.publish(served.name, plan.model_dump_json(), path, tensor_names(weights))
        try:
            result = await asyncio.wrap_future(self.engine.at_boundary(staged.apply))
        except BaseException:
            self._weights.withdraw(sync)
            raise
        self._weights.settle(sync, result.versions)
        self._weights_seq = sync.seq
        self._weights.applied(served.name, sync.seq)
        return result, sync.seq

    async def _catch_up(self) -> None:
        """Apply the fleet's settled syncs this replica lacks, oldest first (the caller holds
        ``_sync_lock``). One that fails here is recorded and raised; the later ones wait behind it, so
        a replica never runs weights out of the fleet's order. One already live (its versions are the
        live ones: versions are never reused) only advances the count."""
        from fv_core.training.sync import WeightSyncPlan

        assert self._weights is not None
        pending = self._weights.after(self._weights_seq, list(self.models))
        while pending:
            sync = pending.pop(0)
            try:
                payload = await asyncio.to_thread(sync.path.read_bytes)
            except FileNotFoundError:  # compacted (this replica is starting): list the rest again
                pending = self._weights.after(self._weights_seq, list(self.models))
                if pending and pending[0].seq == sync.seq:  # still logged: its payload went missing
                    self._weights.failed(sync, f"its payload {str(sync.path)!r} is missing")
                    raise
                continue
            except OSError as exc:
                self._weights.failed(sync, f"reading its payload: {exc}")
                raise
            try:
                plan, served = WeightSyncPlan.model_validate_json(sync.plan), self.models[sync.model]
                live = served.loaded.instance.weights_versions
                if any(live.get(component) != plan.version for component in plan.components):
                    await self._apply(served, plan, payload)
            except Exception as exc:
                self._weights.failed(sync, f"{type(exc).__name__}: {exc}")
                raise
            self._weights_seq = sync.seq
            self._weights.applied(sync.model, sync.seq)

    async def _fleet_caught_up(self, model: str, seq: int) -> dict[str, Any]:
        """Wait (up to ``FLEET_SYNC_WAIT_S``) until every live replica of ``model`` applied ``seq``."""
        assert self._weights is not None
        deadline = time.monotonic() + FLEET_SYNC_WAIT_S
        while (behind := self._weights.behind(model, seq)) and time.monotonic() < deadline:
            await asyncio.sleep(WATCH_S)
        errors = self._weights.failures(model, seq)
        return {"fleet_seq": seq, "replicas_behind": behind, "replica_errors": errors}

    # -- shared ---------------------------------------------------------------------------------------

    @staticmethod
    def _task(
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
        if task not in fit:
            raise ApiError(
                400,
                f"model {served.name!r} has no task {asked!r} that outputs {output}s; its {output} tasks are "
                f"{fit} (all tasks: {list(programs)}). Fix: ask for one of those, or another model.",
                "unsupported_model" if not fit else "invalid_task",
                "task" if asked is not None else "model",
            )
        return task

    @staticmethod
    async def _reference(served: ServedModel, task: str, reference: Any) -> tuple[ImagePart, ...]:
        """``input_reference`` as an image part, for a task whose loop takes images."""
        if reference is None:
            return ()
        loop = served.loaded.card.loops[served.loaded.card.programs[task].stages[0]]
        if "image" not in loop.accepts:
            raise ApiError(
                400,
                f"model {served.name!r} takes no input_reference: its task {task!r} takes no image. "
                "Fix: drop input_reference.",
                "unsupported_parameter",
                "input_reference",
            )
        return await Service.image_parts(reference, "input_reference")

    @staticmethod
    async def image_parts(upload: Any, param: str) -> tuple[ImagePart, ...]:
        """An uploaded image file as an image part; anything else (or an undecodable or oversized image)
        answers 400 naming ``param``."""
        if not hasattr(upload, "read"):
            raise ApiError(
                400,
                f"{param} must be an uploaded image file; got {type(upload).__name__}. "
                "Fix: send it as a multipart file field.",
                "unsupported_parameter",
                param,
            )
        try:
            return (await asyncio.to_thread(image_part, await upload.read()),)
        except ConfigError as exc:
            raise ApiError(400, f"{param}: {exc}", "invalid_image", param) from None

    @staticmethod
    def _raw(body: VideoBase | ImageBase) -> dict[str, Any]:
        """The request params a body sets: its param fields, ``size`` as width/height, a random seed
        when it sets none (omitted params take the card's defaults in ``prepare``)."""
        raw = body.model_dump(exclude=set(API_FIELDS - {"prompt"}), exclude_none=True)
        width, height = parse_size(None if body.size == "auto" else body.size)
        if width is not None:
            raw.update(width=width, height=height)
        raw.setdefault("seed", secrets.randbelow(2**31))
        return raw

    @staticmethod
    def _prepare(
        served: ServedModel, raw: dict[str, Any], task: str, options: dict[str, Any], parts: tuple = ()
    ) -> Request:
        """The typed request; bad values, limits and plugin options answer 400 naming the param."""
        try:
            return served.loaded.prepare(raw, task=task, plugin_options=options, parts=parts)
        except LimitExceeded as exc:
            raise ApiError(400, str(exc), "limit_exceeded", exc.param) from None
        except ConfigError as exc:
            code = "invalid_plugin_options" if exc.param == "plugin_options" else "invalid_request"
            raise ApiError(400, str(exc), code, exc.param) from None

    async def _submit(self, loop: Any, request: Any, instance: Any) -> str:
        """Hand a job to the engine (it answers at once); a full queue is 429."""
        try:
            return await self.engine.submit(loop, request, instance)
        except QueueFull as exc:
            self.metrics.refusals.labels("queue_full").inc()
            retry = str(max(1, math.ceil(exc.retry_after_s)))
            raise ApiError(429, str(exc), "queue_full", headers={"Retry-After": retry}) from None
        except ConfigError as exc:
            self.metrics.refusals.labels("invalid").inc()
            raise ApiError(400, str(exc), "invalid_request") from None

    async def _follow(
        self, rid: str, model: str, start: float, on_progress: Any, on_partial: Any = None
    ) -> LoopResult:
        """Follow a request to its end, reporting ``on_progress(percent)`` and awaiting
        ``on_partial(data)`` for each partial output; return its result."""
        async for event in self._events(rid, model, start):
            if event.kind == "progress":
                on_progress(min(99, 100 * event.step // event.total) if event.total else 0)
            elif event.kind == "partial" and on_partial is not None:
                await on_partial(event.data)
        return await self.engine.result(rid)

    async def _events(self, rid: str, model: str, start: float) -> AsyncGenerator[StreamEvent]:
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


@dataclass(slots=True)
class Image:
    """A generated image as base64 PNG, and the text made with it (the thinking of ``think``)."""

    b64_png: str
    text: str | None = None


def failure(exc: Exception, what: str, metrics: Metrics) -> ApiError:
    """The HTTP answer for a request that failed after it was queued: refusals and bad input found
    by the loop are 400, the rest 500."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, AdmissionInfeasible):  # the engine can never fit it: the request is too big
        metrics.refusals.labels("infeasible").inc()
        return ApiError(400, str(exc), "admission_infeasible")
    if isinstance(exc, ConfigError):  # e.g. a prompt longer than the model's context
        return ApiError(400, str(exc), "invalid_request", exc.param)
    return ApiError(500, f"{what} failed: {type(exc).__name__}: {exc}", "generation_failed")


def parse_size(size: str | None) -> tuple[int | None, int | None]:
    """``"WxH"`` -> (width, height); None -> the card's defaults."""
    if size is None:
        return None, None
    width, height = (int(v) for v in size.split("x"))
    return width, height


def save_atomically(artifact: VideoArtifact, path: Path) -> None:
    """Save the artifact (and its provenance JSON) under hidden names, then move both into place."""
    tmp = artifact.save(path.with_name(f".{path.name}"))
    tmp.with_suffix(".json").replace(path.with_suffix(".json"))
    tmp.replace(path)


def encode_png(frame: np.ndarray) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(to_uint8(frame)).save(out, format="PNG")
    return out.getvalue()


def _log_unheard(push: asyncio.Future) -> None:
    """A weight push whose caller went away: log how it ended, since nobody hears the answer."""
    if push.cancelled():
        log.warning("a weight push whose caller went away was cancelled (the server stopped)")
    elif (error := push.exception()) is not None:
        log.warning("a weight push whose caller went away failed: %s", error)
    else:
        log.info("a weight push whose caller went away is live: %s", push.result()[0].versions)
