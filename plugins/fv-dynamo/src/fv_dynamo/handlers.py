"""Dynamo requests as fv requests: each handler takes the body Dynamo's frontend forwards and runs it on the
worker's own fv server over HTTP, so a request through Dynamo takes exactly the path ``fv serve`` takes
(validation, the job store, determinism) and makes the same bytes.

Dynamo's frontend forwards OpenAI's fields and its ``nvext`` extension (``seed``, ``num_frames``,
``num_inference_steps``, ``guidance_scale``, ``negative_prompt``, ...); other top-level fields never reach a
worker, so fv's request params travel in ``nvext`` under their fv names.

- videos: a job on fv (``POST /v1/videos``), followed to its end; the answer carries the fv job id and
  the mp4 as ``b64_json`` or as a ``url`` to the job's content on this worker's fv server. A client that
  goes away deletes the job (fv cancels it at its next step boundary).
- images: ``POST /v1/images/generations``, answered as fv answers (base64 PNGs).
- chat: ``POST /v1/chat/completions`` streamed, each server-sent chunk passed on as it comes.

Dynamo answers a failed video as a 200 with ``status: "failed"`` and ``error`` (its video protocol);
images and chat fail with fv's status and message (``dynamo.llm.HttpError``).
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
from dynamo.llm import HttpError

POLL_S = 0.05  # how often a running video job is looked at (loopback: cheap)
NVEXT_SKIP = {"annotations"}  # Dynamo's own nvext fields, not request params
IMAGE_FIELDS = ("model", "prompt", "n", "size")
CHAT_DROP = {"nvext", "stream", "stream_options"}


def nvext(request: dict[str, Any]) -> dict[str, Any]:
    """The request's nvext fields that are fv request params (unset ones left out)."""
    ext = request.get("nvext") or {}
    return {k: v for k, v in ext.items() if v is not None and k not in NVEXT_SKIP}


def fv_message(response: httpx.Response) -> str:
    """fv's error message of a failed answer (its ``{"error": {"message": ...}}``)."""
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text or f"HTTP {response.status_code}"


class Handlers:
    """The request handlers of one served model, on the worker's fv server at ``http``'s base URL;
    ``public_url`` is where clients reach that server (video ``url`` answers point there)."""

    def __init__(self, http: httpx.AsyncClient, model: str, public_url: str) -> None:
        self.http, self.model, self.public_url = http, model, public_url.rstrip("/")

    async def videos(self, request: dict[str, Any], context: Any) -> AsyncIterator[dict[str, Any]]:
        start = time.monotonic()
        if request.get("output_format") not in (None, "mp4"):
            message = f"output_format={request['output_format']!r}: fv makes mp4. Fix: send 'mp4' (or leave it out)."
            yield self._failed(None, message, start)
            return
        body = {"model": self.model, "prompt": request.get("prompt"), **nvext(request)}
        for field in ("size", "seconds", "input_reference"):
            if request.get(field) is not None:
                body[field] = request[field]
        answer = await self.http.post("/v1/videos", json=body)
        if answer.status_code != 200:
            yield self._failed(None, fv_message(answer), start)
            return
        job = await self._follow(answer.json(), context)
        if job is None:  # its client went away: the job is deleted
            return
        if job.get("status") != "completed":
            yield self._failed(job["id"], (job.get("error") or {}).get("message", str(job)), start)
            return
        yield {**self._video(job["id"], start), "data": [await self._media(job["id"], request)]}

    async def _follow(self, job: dict[str, Any], context: Any) -> dict[str, Any] | None:
        """The job once it ended; None when Dynamo stopped the request first (the client went away),
        after deleting the job (fv cancels it at its next step boundary)."""
        job_id, ended = job["id"], False
        try:
            while job["status"] in ("queued", "in_progress"):
                if context.is_stopped() or context.is_killed():
                    return None
                await asyncio.sleep(POLL_S)
                answer = await self.http.get(f"/v1/videos/{job_id}")
                if answer.status_code != 200:  # deleted meanwhile (through fv's own API)
                    ended = True
                    return {"id": job_id, "status": "failed", "error": {"message": fv_message(answer)}}
                job = answer.json()
            ended = True
            return job
        finally:
            if not ended:  # stopped, or this task was cancelled
                await asyncio.shield(self.http.delete(f"/v1/videos/{job_id}"))

    async def _media(self, job_id: str, request: dict[str, Any]) -> dict[str, Any]:
        """The mp4 as Dynamo's ``VideoData``: inline (``b64_json``) or a link to it (``url``, the default)."""
        path = f"/v1/videos/{job_id}/content"
        if request.get("response_format") != "b64_json":
            return {"output_format": "mp4", "url": f"{self.public_url}{path}"}
        content = await self.http.get(path)
        content.raise_for_status()
        return {"output_format": "mp4", "b64_json": base64.b64encode(content.content).decode()}

    def _video(self, job_id: str | None, start: float) -> dict[str, Any]:
        return {
            "id": job_id or "",
            "object": "video",
            "model": self.model,
            "status": "completed",
            "progress": 100,
            "created": int(time.time()),
            "inference_time_s": time.monotonic() - start,
        }

    def _failed(self, job_id: str | None, message: str, start: float) -> dict[str, Any]:
        return {**self._video(job_id, start), "status": "failed", "progress": 0, "data": [], "error": message}

    async def images_or_chat(self, request: dict[str, Any], context: Any) -> AsyncIterator[dict[str, Any]]:
        """Images and chat share one Dynamo endpoint (one registration, types Images | Chat): a chat
        request is the one with ``messages``."""
        stream = self._chat(request) if "messages" in request else self._images(request)
        async for item in stream:
            yield item

    async def _images(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        if request.get("response_format") not in (None, "b64_json"):
            raise HttpError(
                400,
                f"response_format={request['response_format']!r}: fv answers images inline. "
                "Fix: send response_format='b64_json' (or leave it out).",
            )
        body = {k: request[k] for k in IMAGE_FIELDS if request.get(k) is not None}
        answer = await self.http.post(
            "/v1/images/generations", json={**body, "model": self.model, **nvext(request)}
        )
        if answer.status_code != 200:
            raise HttpError(answer.status_code, fv_message(answer))
        yield answer.json()

    async def _chat(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        body = {k: v for k, v in request.items() if k not in CHAT_DROP and v is not None}
        # usage in the last chunk when the client streams and asked for it, always when Dynamo folds the
        # chunks into one answer (a client that did not stream)
        usage = (request.get("stream_options") or {}).get("include_usage") or not request.get("stream")
        body.update(
            model=self.model, stream=True, stream_options={"include_usage": bool(usage)}, **nvext(request)
        )
        async with self.http.stream("POST", "/v1/chat/completions", json=body) as answer:
            if answer.status_code != 200:
                await answer.aread()
                raise HttpError(answer.status_code, fv_message(answer))
            async for line in answer.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    yield json.loads(line[len("data: ") :])
