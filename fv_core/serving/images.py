"""``/v1/images``: OpenAI's image generations and edits, answered when the images are made (base64 PNG).

``n`` images are ``n`` requests (seeds ``seed``, ``seed + 1``, ...) that hold at most ``max_running``
places at a time, so other requests get in; a full queue refuses the first. ``think`` (BAGEL) returns
the thinking as each image's ``revised_prompt``.
"""

from __future__ import annotations

import asyncio
import base64
import time
from dataclasses import dataclass

from fastapi import APIRouter, Depends, Request, Response

from fv_core.deploy.card import Limits
from fv_core.request import ImagePart
from fv_core.request import Request as FvRequest
from fv_core.request.params import MAX_SEED
from fv_core.serving.bodies import body_doc, drop_ignored, read_body, uploads, validate
from fv_core.serving.errors import ApiError, failure
from fv_core.serving.media import encode_png
from fv_core.serving.schemas import ImageBase, ImageData, ImageEditBase, ImagesResponse
from fv_core.serving.submission import image_parts, pick_task, prepare, raw_params
from fv_core.serving.workflows import Workflows


@dataclass(slots=True)
class Image:
    """A generated image as base64 PNG, and the text made with it (the thinking of ``think``)."""

    b64_png: str
    text: str | None = None


class Images(Workflows):
    """Image requests: generated (or edited) and answered together."""

    async def generate_images(self, body: ImageBase, parts: tuple[ImagePart, ...] = ()) -> list[Image]:
        """``n`` images as base64 PNGs, each with the text made with it (``think``: the thinking); waits
        for them (like OpenAI's images API). ``parts``: the image to edit."""
        self.check_taking_jobs()
        if body.model in self.workflows and not parts:
            flows = await self.workflow_images(self.workflows[body.model], body)
            pngs = await asyncio.gather(*(asyncio.to_thread(encode_png, a.image) for a in flows))
            return [Image(base64.b64encode(png).decode(), None) for png in pngs]
        served = self.model(body.model)
        raw = raw_params(body)
        think = raw.pop("think", None)
        task = pick_task(served, body.task, "image", image=bool(parts), text=think)
        if parts and "width" in raw and "width" not in served.loaded.params_model(task).model_fields:
            raise ApiError(
                400,
                f"size={body.size!r}: task {task!r} takes its size from the image. Fix: drop size (or send auto).",
                "invalid_request",
                "size",
            )
        seed = raw.pop("seed")
        adapters = [a.model_dump(exclude_none=True) for a in body.adapters]
        requests = [
            prepare(
                served, {**raw, "seed": (seed + i) % MAX_SEED}, task, body.plugin_options, parts, adapters
            )
            for i in range(body.n)
        ]
        first = await self.submit(served, requests[0])  # a full queue refuses the request
        self.metrics.requests.labels(served.name, "image").inc()
        window = asyncio.Semaphore((self.deploy.limits or Limits()).max_running)

        async def one(index: int, request: FvRequest) -> Image:
            async with window:  # an n-image request holds at most max_running places, so others get in
                rid = first if index == 0 else await self.submit_when_room(served, request)
                return await self._image(rid, served.name)

        self.images_in_flight += len(requests)
        try:
            return list(await asyncio.gather(*(one(i, r) for i, r in enumerate(requests))))
        finally:
            self.images_in_flight -= len(requests)

    async def _image(self, rid: str, model: str) -> Image:
        start, status = time.monotonic(), "failed"
        try:
            result = await self.follow(rid, model, start, lambda p: None)
            png = await asyncio.to_thread(encode_png, result.outputs["frames"][0].float().numpy())
            status = "completed"
            text = result.outputs.get("text")
            return Image(base64.b64encode(png).decode(), None if text is None else str(text))
        except Exception as exc:
            raise failure(exc, "image generation", self.metrics) from None
        finally:
            self.metrics.jobs.labels(model, status).inc()
            self.metrics.latency.labels(model, status).observe(time.monotonic() - start)


def _images(request: Request) -> Images:
    return request.app.state.service


def _answer(body: ImageBase, images: list[Image]) -> ImagesResponse:
    data = [ImageData(b64_json=i.b64_png, revised_prompt=i.text) for i in images]
    return ImagesResponse(created=int(time.time()), data=data, size=body.size)


def router(image_body: type[ImageBase], edit_body: type[ImageEditBase]) -> APIRouter:
    """The image routes; the bodies are ``ImageBase`` / ``ImageEditBase`` with the served cards' params."""
    router = APIRouter()

    @router.post("/images/generations", response_model=ImagesResponse, openapi_extra=body_doc(image_body))
    async def generate_images(
        request: Request, response: Response, images: Images = Depends(_images)
    ) -> ImagesResponse:
        body = validate(image_body, drop_ignored(await read_body(request), response))
        return _answer(body, await images.generate_images(body))

    @router.post("/images/edits", response_model=ImagesResponse, openapi_extra=body_doc(edit_body))
    async def edit_images(
        request: Request, response: Response, images: Images = Depends(_images)
    ) -> ImagesResponse:
        """OpenAI's image edit (multipart: ``image`` or ``image[]`` files, the instruction as ``prompt``);
        several images go to the task as several image parts (it refuses more than it takes)."""
        data = drop_ignored(await read_body(request), response)
        files = await uploads(request, "image")
        data["image"] = files[0] if files else data.get("image")
        body = validate(edit_body, data)
        if body.mask is not None:
            raise ApiError(
                400, "mask is not supported: fv edits the whole image. Fix: drop mask.", "unsupported_parameter", "mask"
            )  # fmt: skip
        if not files:
            raise ApiError(
                400, "got no image file; an edit takes one. Fix: send an 'image' file field.", "invalid_image", "image"
            )  # fmt: skip
        parts = tuple([part for file in files for part in await image_parts(file, "image")])
        return _answer(body, await images.generate_images(body, parts))

    return router
