"""The serving glue: deployed models on one AsyncEngine, jobs followed step by step.

Everything here runs on the event loop; model work runs on the engine's
worker thread and mp4 / PNG encoding in ``asyncio.to_thread``, so no request
handler ever waits on the model.
"""

from __future__ import annotations

import asyncio
import base64
import io
import math
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fv_core.deploy.card import DeploymentCard, ModelDeploy
from fv_core.deploy.check import check_deploy, deploy_plugin_options, validate_plugin_options
from fv_core.errors import AdmissionInfeasible, Cancelled, ConfigError, QueueFull
from fv_core.model import LoadedModel, build_interceptors, load_model, resolve_kernels
from fv_core.plugins import PluginHost
from fv_core.runtime import AsyncEngine, Budget, Engine
from fv_core.serving.jobs import JobStore, new_job_id
from fv_core.serving.metrics import Metrics
from fv_core.serving.schemas import MAX_SEED, GenerationExtras, ImageCreate, Video, VideoCreate

IMAGE_TASK = "text_to_image"


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
        limits = deploy.limits
        budget = Budget(max_running=limits.max_running, max_waiting=limits.max_queue)
        self.engine = AsyncEngine(Engine(budget, device=device), batching=True)
        self.live: dict[str, str] = {}  # job id -> engine request id, while running
        self._tasks: set[asyncio.Task] = set()

    # -- lifecycle ------------------------------------------------------------------------------------

    async def start(self) -> None:
        self.models = await asyncio.to_thread(self._load_models)
        await self.engine.start()

    async def stop(self) -> None:
        """Stop the engine (in-flight jobs fail with the reason) and let the job tasks record it."""
        await self.engine.stop()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=30)

    def _load_models(self) -> dict[str, ServedModel]:
        problems = check_deploy(self.deploy, self.host, self.device)
        if problems:
            raise ConfigError("the deployment is invalid:\n" + "\n".join(f"  - {p}" for p in problems))
        now = int(time.time())
        return {m.served_name: ServedModel(m.served_name, m, self._load(m), now) for m in self.deploy.models}

    def _load(self, m: ModelDeploy) -> LoadedModel:
        """``m``'s card on its weights, running the kernels the deploy selects with their plugins' options."""
        options = deploy_plugin_options(self.host, self.deploy)
        card = self.host.card(m.card)
        kernels = resolve_kernels(self.host, card, self.device, options, requested=m.kernels)
        interceptors = build_interceptors(self.host, m.interceptors, options)
        plugin = self.host.registries.cards.plugin_of(m.card)
        return load_model(
            card, m.weights, self.device, plugin=plugin, kernels=kernels, interceptors=interceptors
        )

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

    # -- videos ---------------------------------------------------------------------------------------

    async def create_video(self, body: VideoCreate) -> Video:
        served = self.model(body.model)
        if body.input_reference is not None:
            tasks = sorted(served.loaded.card.capabilities.tasks)
            raise ApiError(
                400,
                f"model {served.name!r} takes no input_reference: it serves {tasks}, none of them "
                "image-conditioned. Fix: drop input_reference.",
                "unsupported_parameter",
                "input_reference",
            )
        width, height = parse_size(body.size)
        frames = body.num_frames
        if frames is None and body.seconds is not None:
            frames = round(body.seconds * body.fps) + 1
        params = self._params(served, body, frames, width, height)
        loop, request, instance = self._job(served, params, _seed(body.seed), None)
        rid = await self._submit(loop, request, instance)
        job_id = new_job_id()
        seconds = f"{frames / body.fps:g}" if frames is not None else "auto"
        video = self.store.create(job_id, served.name, body.size or "auto", seconds, body.prompt)
        self.live[job_id] = rid
        self.metrics.requests.labels(served.name, "video").inc()
        task = asyncio.create_task(self._run_video(job_id, rid, served.name, body.fps))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return video

    async def _run_video(self, job_id: str, rid: str, model: str, fps: int) -> None:
        start, status = time.monotonic(), "failed"
        try:
            frames = await self._follow(rid, model, start, lambda p: self.store.progress(job_id, p))
            path = self.store.video_path(job_id)
            size, seconds = await asyncio.to_thread(write_mp4, path, frames, fps)
            if self.store.complete(job_id, size, seconds):
                status = "completed"
            else:  # deleted while the file was written
                path.unlink(missing_ok=True)
                status = "cancelled"
        except Cancelled as exc:
            self.store.fail(job_id, "cancelled", str(exc))  # a no-op when the job was deleted
            status = "cancelled"
        except Exception as exc:  # the job fails with the reason; the server keeps serving
            self.store.fail(job_id, "generation_failed", f"{type(exc).__name__}: {exc}")
        finally:
            self.live.pop(job_id, None)
            self.metrics.jobs.labels(model, status).inc()
            self.metrics.latency.labels(model, status).observe(time.monotonic() - start)

    def delete(self, job_id: str) -> bool:
        """Delete a job and its file; a running one is cancelled at its next step boundary."""
        rid = self.live.get(job_id)
        if rid is not None:
            self.engine.cancel(rid, "the video was deleted")
        return self.store.delete(job_id)

    # -- images ---------------------------------------------------------------------------------------

    async def generate_images(self, body: ImageCreate) -> list[str]:
        """``n`` images as base64 PNGs; waits for them (like OpenAI's images API)."""
        served = self.model(body.model)
        tasks = served.loaded.card.capabilities.tasks
        if IMAGE_TASK not in tasks:
            raise ApiError(
                400,
                f"model {served.name!r} does not generate images (it serves {sorted(tasks)}). "
                f"Fix: use a model that serves {IMAGE_TASK!r}.",
                "unsupported_model",
                "model",
            )
        width, height = parse_size(None if body.size == "auto" else body.size)
        params = self._params(served, body, 1, width, height)
        seed = _seed(body.seed)
        rids: list[str] = []
        try:
            for i in range(body.n):
                rids.append(await self._submit(*self._job(served, params, (seed + i) % MAX_SEED, IMAGE_TASK)))
        except ApiError:
            await asyncio.gather(*(self._abandon(rid) for rid in rids))
            raise
        self.metrics.requests.labels(served.name, "image").inc()
        return list(await asyncio.gather(*(self._image(rid, served.name) for rid in rids)))

    async def _image(self, rid: str, model: str) -> str:
        start, status = time.monotonic(), "failed"
        try:
            frames = await self._follow(rid, model, start, lambda p: None)
            png = await asyncio.to_thread(encode_png, frames[0])
            status = "completed"
            return base64.b64encode(png).decode()
        except Exception as exc:
            raise ApiError(
                500, f"image generation failed: {type(exc).__name__}: {exc}", "generation_failed"
            ) from None
        finally:
            self.metrics.jobs.labels(model, status).inc()
            self.metrics.latency.labels(model, status).observe(time.monotonic() - start)

    async def _abandon(self, rid: str) -> None:
        """Cancel a submitted request and drop its record."""
        self.engine.cancel(rid, "a sibling image was refused")
        try:
            await self.engine.result(rid)
        except Exception:  # Cancelled, or whatever ended it first
            pass

    # -- shared ---------------------------------------------------------------------------------------

    def _params(
        self,
        served: ServedModel,
        body: GenerationExtras,
        frames: int | None,
        width: int | None,
        height: int | None,
    ) -> dict:
        """Loop parameters after the deployment's limits and the plugin-option trust boundary.

        Omitted values are checked as the card's defaults, which the loop will use."""
        limits, defaults = self.deploy.limits, served.loaded.card.defaults

        def or_default(given: Any, name: str) -> Any:
            return defaults.get(name) if given is None else given

        checks = (
            (
                "num_frames",
                or_default(frames, "num_frames"),
                limits.max_frames,
                "max_frames",
                "fewer frames (or seconds)",
            ),
            ("width", or_default(width, "width"), limits.max_width, "max_width", "a smaller size"),
            ("height", or_default(height, "height"), limits.max_height, "max_height", "a smaller size"),
            (
                "num_inference_steps",
                or_default(body.num_inference_steps, "steps"),
                limits.max_steps,
                "max_steps",
                "fewer steps",
            ),
            (
                "guidance_scale",
                or_default(body.guidance_scale, "guidance"),
                limits.max_guidance,
                "max_guidance",
                "a lower guidance",
            ),
        )
        for param, value, limit, rule, fix in checks:
            if value is not None and value > limit:
                raise ApiError(
                    400,
                    f"{param}={value} exceeds this deployment's limit {rule}={limit}. Fix: ask for {fix}, "
                    f"at most {limit}.",
                    "limit_exceeded",
                    param,
                )
        options: dict[str, Any] = {}
        for plugin, opts in body.plugin_options.items():
            try:
                options[plugin] = validate_plugin_options(self.host, self.deploy, plugin, opts).model_dump(
                    exclude_unset=True
                )
            except ConfigError as exc:
                raise ApiError(400, str(exc), "invalid_plugin_options", "plugin_options") from None
        params = {
            "prompt": getattr(body, "prompt", None),
            "negative_prompt": body.negative_prompt,
            "num_frames": frames,
            "height": height,
            "width": width,
            "steps": body.num_inference_steps,
            "guidance": body.guidance_scale,
            "plugin_options": options or None,
        }
        return {k: v for k, v in params.items() if v is not None}

    @staticmethod
    def _job(served: ServedModel, params: dict, seed: int, task: str | None) -> tuple[Any, Any, Any]:
        try:
            return served.loaded.job(params, seed, task)
        except ConfigError as exc:
            raise ApiError(400, str(exc), "invalid_request") from None

    async def _submit(self, loop: Any, request: Any, instance: Any) -> str:
        """Hand a job to the engine; refusals become 429 / 400 answers."""
        try:
            return await self.engine.submit(loop, request, instance)
        except QueueFull as exc:
            self.metrics.refusals.labels("queue_full").inc()
            retry = str(max(1, math.ceil(exc.retry_after_s)))
            raise ApiError(429, str(exc), "queue_full", headers={"Retry-After": retry}) from None
        except AdmissionInfeasible as exc:
            self.metrics.refusals.labels("infeasible").inc()
            raise ApiError(400, str(exc), "admission_infeasible") from None
        except ConfigError as exc:
            self.metrics.refusals.labels("invalid").inc()
            raise ApiError(400, str(exc), "invalid_request") from None

    async def _follow(self, rid: str, model: str, start: float, on_progress: Any) -> np.ndarray:
        """Stream a request's events into metrics and ``on_progress(percent)``; return its frames."""
        self.metrics.queued.inc()
        started, last_step = False, 0
        try:
            async for event in self.engine.stream(rid):
                if event.kind != "progress":
                    continue
                if not started:
                    started = True
                    self.metrics.queued.dec()
                    self.metrics.running.inc()
                    self.metrics.queue_wait.labels(model).observe(time.monotonic() - start)
                for _ in range(event.step - last_step):
                    self.metrics.step(model)
                last_step = event.step
                on_progress(min(99, 100 * event.step // event.total) if event.total else 0)
            result = await self.engine.result(rid)
            self.metrics.cache_stats(model, result.metrics)
        finally:
            (self.metrics.running if started else self.metrics.queued).dec()
        return result.outputs["frames"].detach().cpu().float().numpy()


def parse_size(size: str | None) -> tuple[int | None, int | None]:
    """``"WxH"`` -> (width, height); None -> the card's defaults."""
    if size is None:
        return None, None
    width, height = (int(v) for v in size.split("x"))
    return width, height


def _seed(seed: int | None) -> int:
    return seed if seed is not None else secrets.randbelow(2**31)


def _uint8(frames: np.ndarray) -> np.ndarray:
    return (np.clip(frames, 0.0, 1.0) * 255).round().astype(np.uint8)


def write_mp4(path: Path, frames: np.ndarray, fps: int) -> tuple[str, str]:
    """Write frames [F, H, W, 3] in 0..1 as H.264 mp4 (atomically); returns (size, seconds)."""
    import imageio.v2 as imageio

    tmp = path.with_name(f".{path.name}")
    imageio.mimwrite(tmp, list(_uint8(frames)), fps=fps, codec="libx264", quality=8, macro_block_size=1)
    tmp.replace(path)
    count, height, width = frames.shape[:3]
    return f"{width}x{height}", f"{count / fps:g}"


def encode_png(frame: np.ndarray) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(_uint8(frame)).save(out, format="PNG")
    return out.getvalue()
