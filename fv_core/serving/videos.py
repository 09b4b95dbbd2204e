"""``/v1/videos``: video jobs, as OpenAI's videos API (create, list, retrieve, content, delete) plus fv's
``/stream`` of a running job's chunks.

A video is a job: created at once (queued in the engine), followed in the background, its mp4 and
provenance saved to the artifact storage when it completes (the way ``fv generate`` saves them). Jobs
survive restarts: a queued job a stopped server kept (with its upload) runs again on the next one; on a
shared store (a fleet), a replica cancels its jobs deleted through another replica and takes over the
jobs of replicas that stopped. Any replica serves any job's mp4; on S3 storage a completed job also
carries a presigned link (``download_url``, and the ``x-fv-download-url`` header of its retrieval). A
job's files are published (uploaded to a bucket) in a thread, so a slow bucket stalls no other request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Literal

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import FileResponse, StreamingResponse
from starlette.concurrency import iterate_in_threadpool

from fv_core.artifacts import VideoArtifact
from fv_core.deploy.card import DeploymentCard
from fv_core.errors import AdmissionInfeasible, Cancelled
from fv_core.plugins import PluginHost
from fv_core.request import Request as FvRequest
from fv_core.serving.bodies import body_doc, drop_ignored, read_body, validate
from fv_core.serving.errors import ApiError
from fv_core.serving.jobs import JobStore, new_job_id
from fv_core.serving.media import save_atomically
from fv_core.serving.metrics import Metrics
from fv_core.serving.schemas import Video, VideoBase, VideoDeleted, VideoList
from fv_core.serving.stream import VideoChunks, events
from fv_core.serving.submission import (
    RECOVER_S,
    WATCH_S,
    ServedModel,
    decode_image,
    pick_task,
    prepare,
    raw_params,
    upload_bytes,
)
from fv_core.serving.workflows import Workflows

log = logging.getLogger("fv.serving")
POLL_AFTER_MS = "200"  # hint for the openai client's create_and_poll


class Videos(Workflows):
    """Video jobs: created, followed to their saved mp4, deleted (cancelled), kept over restarts."""

    def __init__(
        self, deploy: DeploymentCard, host: PluginHost, store: JobStore, metrics: Metrics, device: str = "cpu"
    ) -> None:
        super().__init__(deploy, host, store, metrics, device)
        self.live: dict[str, str] = {}  # job id -> engine request id, while running
        self.streams: dict[str, VideoChunks] = {}  # job id -> the chunks it streamed, while running

    @property
    def queue_depth(self) -> int:
        """Work this server has accepted and not finished: video jobs (queued or running) and the images
        synchronous image requests wait for."""
        return len(self.live) + self.images_in_flight

    def sweep(self) -> None:
        """Apply the deployment's retention (expired jobs, then the disk cap)."""
        self.store.sweep(self.deploy.retention.max_bytes)

    async def create_video(self, body: VideoBase, request_id: str | None = None) -> Video:
        self.check_taking_jobs()
        if body.model in self.workflows:
            return await self.create_workflow_video(self.workflows[body.model], body, request_id)
        served = self.model(body.model)
        task = pick_task(served, body.task, "video", image=body.input_reference is not None)
        program = served.loaded.card.programs[task]
        upload = await _reference(served, task, body.input_reference)
        parts = await decode_image(upload, "input_reference") if upload is not None else ()
        raw = raw_params(body)
        if body.seconds is not None and "num_frames" not in raw:
            raw["num_frames"] = round(body.seconds * raw.get("fps", program.defaults.get("fps", 16))) + 1
        adapters = [a.model_dump(exclude_none=True) for a in body.adapters]
        request = prepare(served, raw, task, body.plugin_options, parts, adapters)
        rid = await self.submit(served, request)
        job_id = new_job_id()
        p = request.params
        size = f"{p.width}x{p.height}" if hasattr(p, "width") else "auto"
        seconds = f"{p.num_frames / p.fps:g}" if hasattr(p, "num_frames") and hasattr(p, "fps") else "auto"
        kept = {"raw": raw, "task": task, "plugin_options": body.plugin_options, "adapters": adapters}
        video = self.store.create(job_id, served.name, size, seconds, body.prompt, kept, request_id, upload)
        log.info("job %s created by request %s", job_id, request_id)
        self.metrics.requests.labels(served.name, "video").inc()
        self._follow_video(job_id, rid, served, request)
        return video

    def delete(self, job_id: str) -> bool:
        """Delete a job and its file; a running one is cancelled at its next step boundary."""
        rid = self.live.get(job_id)
        if rid is not None:
            self.engine.cancel(rid, "the video was deleted")
        return self.store.delete(job_id)

    def requeue(self) -> None:
        """Run again, in the background, the queued jobs a stopped server kept."""
        self.spawn(self._requeue())

    async def watch_jobs(self) -> None:
        """Shared store: cancel (at the next step boundary) the jobs running here that were deleted
        through another replica, and now and then take over the jobs of replicas that stopped."""
        last_recovery, cancelled = time.monotonic(), set[str]()
        while True:
            await asyncio.sleep(WATCH_S)
            try:
                cancelled &= set(self.live)
                for job_id in set(self.store.lost(list(self.live))) - cancelled:
                    rid = self.live.get(job_id)
                    if rid is not None:
                        self.engine.cancel(rid, "the video was deleted")
                        cancelled.add(job_id)
                if not self.draining and time.monotonic() - last_recovery >= RECOVER_S:
                    last_recovery = time.monotonic()
                    if self.store.recover():
                        log.warning("failed the running jobs of a replica that stopped")
                    self.requeue()
            except Exception:  # a busy database: try again next round
                log.exception("watching the shared job store failed")

    def _follow_video(self, job_id: str, rid: str, served: ServedModel, request: FvRequest) -> None:
        self.live[job_id] = rid
        self.streams[job_id] = VideoChunks()
        self.spawn(self._run_video(job_id, rid, served, request))

    async def _requeue(self) -> None:
        """Run again the queued jobs a stopped server kept (the same request and seed)."""
        for job_id, model, kept in self.store.claim_queued(list(self.models)):
            try:
                served = self.model(model)
                upload = self.store.upload(job_id)
                parts = await decode_image(upload, "input_reference") if upload is not None else ()
                request = prepare(
                    served, kept["raw"], kept["task"], kept["plugin_options"], parts, kept.get("adapters")
                )
            except ApiError as exc:  # the deployment changed meanwhile
                self.store.fail(
                    job_id, "server_restart", f"after the restart this job cannot run: {exc.message}"
                )
                continue
            rid = await self.submit_when_room(served, request)
            self._follow_video(job_id, rid, served, request)

    async def _run_video(self, job_id: str, rid: str, served: ServedModel, request: FvRequest) -> None:
        """Follow the job, then save its artifact (the mp4, with sound when the task makes it, and the
        provenance JSON beside it) the way ``fv generate`` saves it."""
        model, start, status = served.name, time.monotonic(), "failed"
        try:
            chunks = self.streams[job_id]

            async def chunk(partial: object) -> None:  # a streaming loop's new frames
                if isinstance(partial, dict) and "frames" in partial:
                    await chunks.add(partial["frames"].float().cpu().numpy())

            result = await self.follow(rid, model, start, lambda p: self.store.progress(job_id, p), chunk)
            artifact = served.loaded.artifact(request, result, time.monotonic() - start)
            assert isinstance(artifact, VideoArtifact), "create_video runs tasks that output video"
            path = self.store.video_path(job_id)
            await asyncio.to_thread(save_atomically, artifact, path)
            nbytes = await asyncio.to_thread(self.store.publish, job_id)  # a bucket's upload: off the loop
            count, height, width = artifact.frames.shape[:3]
            if self.store.complete(job_id, f"{width}x{height}", f"{count / artifact.fps:g}", nbytes):
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


async def _reference(served: ServedModel, task: str, reference: object) -> bytes | None:
    """The bytes of ``input_reference``, for a task whose loop takes images."""
    if reference is None:
        return None
    loop = served.loaded.card.loops[served.loaded.card.programs[task].stages[0]]
    if "image" not in loop.accepts:
        raise ApiError(
            400,
            f"model {served.name!r} takes no input_reference: its task {task!r} takes no image. "
            "Fix: drop input_reference.",
            "unsupported_parameter",
            "input_reference",
        )
    return await upload_bytes(reference, "input_reference")


def _videos(request: Request) -> Videos:
    return request.app.state.service


def _video(videos: Videos, video_id: str) -> Video:
    video = videos.store.get(video_id)
    if video is None:
        raise _no_video(video_id)
    return video


def _no_video(video_id: str) -> ApiError:
    return ApiError(
        404,
        f"no video {video_id[:80]!r}. Fix: use an id from POST /v1/videos or GET /v1/videos.",
        "video_not_found",
        "video_id",
    )


def router(video_body: type[VideoBase]) -> APIRouter:
    """The video routes; ``video_body`` is ``VideoBase`` with the served cards' request params."""
    router = APIRouter()

    @router.post("/videos", response_model=Video, openapi_extra=body_doc(video_body))
    async def create_video(request: Request, response: Response, videos: Videos = Depends(_videos)) -> Video:
        body = validate(video_body, drop_ignored(await read_body(request), response))
        return await videos.create_video(body, request.state.request_id)

    @router.get("/videos", response_model=VideoList)
    async def list_videos(
        after: str | None = Query(None, max_length=64),
        limit: int = Query(20, ge=1, le=100),
        order: Literal["asc", "desc"] = "desc",
        videos: Videos = Depends(_videos),
    ) -> VideoList:
        data, has_more = videos.store.list(after, limit, order)
        first, last = (data[0].id, data[-1].id) if data else (None, None)
        return VideoList(data=data, first_id=first, last_id=last, has_more=has_more)

    @router.get("/videos/{video_id}", response_model=Video)
    async def retrieve_video(video_id: str, response: Response, videos: Videos = Depends(_videos)) -> Video:
        response.headers["openai-poll-after-ms"] = POLL_AFTER_MS
        video = _video(videos, video_id)
        if video.download_url is not None:
            response.headers["x-fv-download-url"] = video.download_url  # S3 storage: a presigned link
        return video

    @router.get(
        "/videos/{video_id}/content",
        response_class=FileResponse,
        responses={200: {"content": {"video/mp4": {}}}},
    )
    async def video_content(
        video_id: str, variant: Literal["video", "stages"] = "video", videos: Videos = Depends(_videos)
    ) -> Response:
        """The mp4 (``variant=stages``: a zip of a workflow's stage artifacts, for a workflow that keeps
        them), from the artifact storage (any replica serves any job's)."""
        video = _video(videos, video_id)
        if variant == "stages":
            return _stages(videos, video)
        key = videos.store.artifact(video_id)
        if key is None:
            raise ApiError(
                409,
                f"video {video_id!r} is {video.status}; content exists only for completed videos. "
                "Fix: poll GET /v1/videos/{id} until status is 'completed'.",
                "video_not_ready",
                "video_id",
            )
        local = videos.store.storage.local(key)
        if local is not None:
            return FileResponse(local, media_type="video/mp4", filename=f"{video_id}.mp4")
        disposition = {"content-disposition": f'attachment; filename="{video_id}.mp4"'}
        chunks = iterate_in_threadpool(videos.store.storage.chunks(key))
        return StreamingResponse(chunks, media_type="video/mp4", headers=disposition)

    @router.get(
        "/videos/{video_id}/stream",
        response_class=StreamingResponse,
        responses={200: {"content": {"text/event-stream": {}}}},
    )
    async def stream_video(video_id: str, videos: Videos = Depends(_videos)) -> StreamingResponse:
        """The job's chunks as server-sent events while it runs (see ``fv_core.serving.stream``), then
        the job; a job not running here sends the job alone."""
        _video(videos, video_id)
        body = events(video_id, videos.streams.get(video_id), lambda: _video(videos, video_id))
        return StreamingResponse(body, media_type="text/event-stream", headers={"cache-control": "no-cache"})

    @router.delete("/videos/{video_id}", response_model=VideoDeleted)
    async def delete_video(video_id: str, videos: Videos = Depends(_videos)) -> VideoDeleted:
        if not videos.delete(video_id):
            raise _no_video(video_id)
        return VideoDeleted(id=video_id)

    return router


def _stages(videos: Videos, video: Video) -> Response:
    """A completed workflow job's stage artifacts (``keep: all``): a zip of each stage's file."""
    key = videos.store.artifact(video.id, stages=True)
    if key is None:
        raise ApiError(
            404 if video.status == "completed" else 409,
            f"video {video.id!r} ({video.status}) has no stage artifacts: only a completed job of a workflow "
            "declared with keep: all has them. Fix: declare the workflow with keep: all, or ask for variant=video.",
            "stages_not_found",
            "variant",
        )
    disposition = {"content-disposition": f'attachment; filename="{video.id}.stages.zip"'}
    chunks = iterate_in_threadpool(videos.store.storage.chunks(key))
    return StreamingResponse(chunks, media_type="application/zip", headers=disposition)
