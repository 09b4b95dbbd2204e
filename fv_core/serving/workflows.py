"""Workflows served by id (fv): a deploy file's ``workflows:`` on ``/v1/videos`` and ``/v1/images``.

A workflow job runs its stages on the server's engine: each stage's requests are submitted like any
other request (they batch with the direct requests on the same model) and followed to their end, the
next stage bound to what the last one made. The job's progress is its stage's; deleting it cancels the
stage running; a failing stage fails the job naming the stage. The saved file's provenance nests every
stage's.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

from fv_core.artifacts import ImageArtifact, VideoArtifact
from fv_core.errors import Cancelled, ConfigError
from fv_core.serving.errors import ApiError
from fv_core.serving.jobs import new_job_id
from fv_core.serving.media import save_atomically
from fv_core.serving.schemas import ImageBase, Video, VideoBase
from fv_core.serving.submission import Jobs, raw_params
from fv_core.workflow import LoadedWorkflow, bind_workflows, deploy_workflows
from fv_core.workflow.run import StageRun

log = logging.getLogger("fv.serving")


class Workflows(Jobs):
    """The deploy file's workflows over the served models."""

    workflows: dict[str, LoadedWorkflow] = {}  # noqa: RUF012  # set once the models load (Service.start)
    live: dict[str, str]  # job id -> its engine request id (Videos sets it)

    def load_workflows(self) -> dict[str, LoadedWorkflow]:
        """Each workflow bound to the served models (nested ones to each other) and its scorers."""
        return bind_workflows(
            deploy_workflows(self.deploy, self.host),
            lambda name: self.models[name].loaded,
            self.host,
            self.deploy.model_dump(mode="json"),
        )

    def workflow_params(self, flow: LoadedWorkflow, body: VideoBase | ImageBase) -> Any:
        """The body's params as the workflow's request (400 naming what it does not take)."""
        raw = raw_params(body)
        extra = sorted(set(raw) - set(flow.spec.params) - {"seed"})
        if extra:
            raise ApiError(
                400,
                f"workflow {flow.workflow_id!r} takes the params {sorted(flow.spec.params)}; the request also "
                f"sets {extra}. Fix: drop them (a stage's other params are set in the workflow).",
                "invalid_request",
                extra[0],
            )
        if "seed" not in flow.spec.params:
            raw.pop("seed", None)
        try:
            return flow.prepare(raw)
        except ConfigError as exc:
            raise ApiError(400, str(exc), "invalid_request", exc.param) from None

    async def create_workflow_video(
        self, flow: LoadedWorkflow, body: VideoBase, request_id: str | None
    ) -> Video:
        params = self.workflow_params(flow, body)
        job_id = new_job_id()
        video = self.store.create(job_id, flow.workflow_id, "auto", "auto", body.prompt, None, request_id)
        self.metrics.requests.labels(flow.workflow_id, "video").inc()
        self.live[job_id] = ""  # the stage running (its engine request id, once submitted)
        self.spawn(self._run_workflow_video(job_id, flow, params))
        return video

    async def run_workflow(self, flow: LoadedWorkflow, params: Any, job_id: str | None = None) -> Any:
        """Run ``flow``'s stages on the engine; each request is followed (its progress the job's)."""
        start = time.monotonic()

        async def execute(stage: StageRun) -> list:
            model, served = stage.model, self.models[stage.model]
            rids = [await self.submit_when_room(served, r) for r in stage.requests]
            if job_id is not None:
                self.live[job_id] = rids[-1]
            progress = (lambda p: self.store.progress(job_id, p)) if job_id is not None else (lambda p: None)
            try:
                return list(await asyncio.gather(*(self.follow(rid, model, start, progress) for rid in rids)))
            except BaseException:
                for rid in rids:  # a failed or cancelled candidate ends its siblings
                    self.engine.cancel(rid, "another request of the workflow's stage ended")
                raise

        return await flow.arun(params, execute)

    async def _run_workflow_video(self, job_id: str, flow: LoadedWorkflow, params: Any) -> None:
        status = "failed"
        try:
            artifact = await self.run_workflow(flow, params, job_id)
            if not isinstance(artifact, VideoArtifact):
                raise ConfigError(
                    f"workflow {flow.workflow_id!r} ends in {type(artifact).__name__}, not a video"
                )
            path = self.store.video_path(job_id)
            await asyncio.to_thread(save_atomically, artifact, path)
            if artifact.stages:  # keep: all
                await asyncio.to_thread(save_stages, artifact.stages, self.store.stages_path(job_id))
            nbytes = await asyncio.to_thread(self.store.publish, job_id)  # a bucket's upload: off the loop
            count, height, width = artifact.frames.shape[:3]
            status = (
                "completed"
                if self.store.complete(job_id, f"{width}x{height}", f"{count / artifact.fps:g}", nbytes)
                else "cancelled"
            )
        except Cancelled as exc:
            self.store.fail(job_id, "cancelled", str(exc))
            status = "cancelled"
        except Exception as exc:  # the job fails with the stage's reason; the server keeps serving
            log.exception("workflow job %s failed", job_id)
            self.store.fail(
                job_id, "generation_failed", f"workflow {flow.workflow_id!r}: {type(exc).__name__}: {exc}"
            )
        finally:
            self.live.pop(job_id, None)
            self.metrics.jobs.labels(flow.workflow_id, status).inc()

    async def workflow_images(self, flow: LoadedWorkflow, body: ImageBase) -> list[ImageArtifact]:
        """``n`` runs of an image workflow (seeds seed, seed+1, ...), concurrently on the engine."""
        params = self.workflow_params(flow, body)
        runs = [
            params.model_copy(update={"seed": params.seed + i}) if "seed" in flow.spec.params else params
            for i in range(body.n)
        ]
        artifacts = await asyncio.gather(*(self.run_workflow(flow, p) for p in runs))
        if not all(isinstance(a, ImageArtifact) for a in artifacts):
            raise ApiError(
                400,
                f"workflow {flow.workflow_id!r} makes a video, not images. Fix: use POST /v1/videos.",
                "invalid_request",
                "model",
            )
        return list(artifacts)


def save_stages(stages: dict[str, Any], path: Path) -> None:
    """Each stage's artifact (``NAME.mp4`` or ``NAME.png``, its provenance ``NAME.json``) zipped into ``path``."""
    with tempfile.TemporaryDirectory() as folder:
        written = []
        for name, artifact in stages.items():
            saved = artifact.save(Path(folder) / f"{name}{'.mp4' if hasattr(artifact, 'frames') else '.png'}")
            written += [saved, saved.with_suffix(".json")]
        partial = path.with_name(f".{path.name}.partial")
        with zipfile.ZipFile(partial, "w") as archive:
            for file in written:
                archive.write(file, file.name)
        partial.replace(path)
