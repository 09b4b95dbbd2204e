"""``/v1/chat/completions``: OpenAI messages as a request's parts and prompt, and answers as OpenAI's
completion (or its server-sent chunks when ``stream`` is set).

A model's conversation has no roles (BAGEL's interleaved context): every message's texts and images
become the request's parts in order, and the last user text is its prompt. Images come as data URLs
(fv fetches nothing from the network).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import re
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import StreamingResponse

from fv_core.errors import ConfigError
from fv_core.request import Part, TextPart, image_part
from fv_core.serving.bodies import drop_ignored, read_body, validate
from fv_core.serving.errors import ApiError, failure
from fv_core.serving.schemas import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionCreate,
    ChatMessage,
    ChunkChoice,
    ChunkDelta,
    ImageContent,
    Usage,
)
from fv_core.serving.submission import Jobs, ServedModel, pick_task, prepare

DATA_URL = re.compile(r"^data:image/[\w.+-]+;base64,(?P<data>.*)$", re.DOTALL)
FINISH = {"eos": "stop", "stop": "stop", "max_tokens": "length"}  # the loop's stop reason -> OpenAI's
ROUTES = {"video": "/v1/videos", "image": "/v1/images/generations"}  # where a task's main output is asked for
Delta = str | dict[str, Any]  # a chat's text as it is made: text deltas, then its result's metrics


class Chats(Jobs):
    """Chat completions: queued, then their text followed delta by delta."""

    async def chat(self, body: ChatCompletionCreate) -> tuple[str, str]:
        """Queue a chat completion; returns (served model name, engine request id)."""
        self.check_taking_jobs()
        served = self.model(body.model)
        check_answers_in_text(served)
        task = pick_task(served, None, "text")
        try:
            parts, prompt = await asyncio.to_thread(conversation, body.messages)  # decodes the images
        except ConfigError as exc:
            raise ApiError(400, str(exc), "invalid_request", exc.param) from None
        raw = {**params(body), "prompt": prompt}
        raw.setdefault("seed", secrets.randbelow(2**31))
        request = prepare(served, raw, task, body.plugin_options, tuple(parts))
        rid = await self.submit(served, request)
        self.metrics.requests.labels(served.name, "chat").inc()
        return served.name, rid

    async def chat_text(self, rid: str, model: str) -> AsyncIterator[Delta]:
        """A chat's text deltas as they are made, then its result's metrics. A failure before the first
        token raises the ApiError (so the answer is a 4xx, not a broken stream); closing the iterator
        early (the client left) cancels the request at its next step."""
        start, status, ended = time.monotonic(), "failed", False
        events = self.events(rid, model, start)
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
                self.spawn(self._settle(rid))
            self.metrics.jobs.labels(model, status).inc()
            self.metrics.latency.labels(model, status).observe(time.monotonic() - start)

    async def _settle(self, rid: str) -> None:
        """Collect an abandoned request's outcome so the engine forgets it."""
        with contextlib.suppress(Exception):
            await self.engine.result(rid)


def check_answers_in_text(served: ServedModel) -> None:
    """A 400 naming the model's tasks, what they output and where to ask for it, when it has no text task."""
    programs = served.loaded.card.programs
    if any(program.outputs[0] == "text" for program in programs.values()):
        return
    tasks = ", ".join(f"{task} ({program.outputs[0]})" for task, program in programs.items())
    routes = sorted({ROUTES[p.outputs[0]] for p in programs.values() if p.outputs[0] in ROUTES})
    raise ApiError(
        400,
        f"model {served.name!r} cannot chat: chat needs a task that answers in text, and its tasks are "
        f"{tasks}. Fix: chat with a model that has a text task (e.g. bagel-tiny, from plugins/fv-bagel), "
        f"or ask this one through {' or '.join(routes) or 'its own route'}.",
        "unsupported_model",
        "model",
    )


def _chats(request: Request) -> Chats:
    return request.app.state.service


def router() -> APIRouter:
    """The chat completion route."""
    router = APIRouter()

    @router.post(
        "/chat/completions",
        response_model=ChatCompletion,
        responses={200: {"content": {"text/event-stream": {}}}},
        openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
            "schema": ChatCompletionCreate.model_json_schema()}}}},
    )  # fmt: skip
    async def chat_completions(
        request: Request, response: Response, chats: Chats = Depends(_chats)
    ) -> ChatCompletion | StreamingResponse:
        """OpenAI's chat completion; ``stream: true`` answers server-sent chunks ending with ``[DONE]``."""
        body = validate(ChatCompletionCreate, drop_ignored(await read_body(request), response))
        model, rid = await chats.chat(body)
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        text = chats.chat_text(rid, model)
        # bad input the loop finds (a prompt over the context) is a 4xx, not a stream
        first = await anext(text)
        if body.stream:
            include = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(
                sse(cid, created, model, _prepend(first, text), include),
                media_type="text/event-stream",
                headers={**response.headers, "cache-control": "no-cache"},  # the ignored-fields header
            )
        pieces = [first] + [item async for item in text]
        metrics = pieces.pop()
        assert isinstance(metrics, dict), "chat_text ends with the result's metrics"
        return completion(cid, created, model, "".join(map(str, pieces)), metrics)

    return router


async def _prepend(first: Delta, rest: AsyncIterator[Delta]) -> AsyncIterator[Delta]:
    yield first
    async for item in rest:
        yield item


def conversation(messages: list[ChatMessage]) -> tuple[list[Part], str]:
    """The messages as parts (texts and decoded images, in order) and the prompt: the last message's last
    text (its images stay before it, as OpenAI's [question, image] messages mean). Raises ConfigError
    naming the message and the fix."""
    last = messages[-1]
    if last.role != "user":
        raise ConfigError(
            f"the last message is the {last.role}'s; a completion answers a user message. "
            "Fix: end messages with one whose role is 'user'.",
            param="messages",
        )
    turns = [_parts(m, f"messages[{i}]") for i, m in enumerate(messages)]
    texts = [i for i, part in enumerate(turns[-1]) if isinstance(part, TextPart)]
    if not texts:
        raise ConfigError(
            f"messages[{len(messages) - 1}] (the last user message) has no text, so there is nothing to "
            "answer. Fix: add the question as a text part.",
            param="messages",
        )
    prompt = turns[-1].pop(texts[-1])
    assert isinstance(prompt, TextPart)
    return [part for turn in turns for part in turn], prompt.text


def _parts(message: ChatMessage, where: str) -> list[Part]:
    items = [message.content] if isinstance(message.content, str) else message.content
    parts: list[Part] = []
    for item in items:
        if isinstance(item, ImageContent):
            parts.append(_image(item.image_url.url, where))
        elif text := (item if isinstance(item, str) else item.text):
            parts.append(TextPart(text))
    return parts


def _image(url: str, where: str) -> Part:
    match = DATA_URL.match(url)
    if match is None:
        shown = url[:60] + ("..." if len(url) > 60 else "")
        raise ConfigError(
            f"{where}: image_url {shown!r} is not a base64 data URL; fv fetches nothing from the network. "
            "Fix: send data:image/png;base64,<the file's bytes in base64>.",
            param="messages",
        )
    try:
        data = base64.b64decode(match["data"], validate=True)
    except (binascii.Error, ValueError):
        raise ConfigError(
            f"{where}: the image's data URL is not valid base64. Fix: base64-encode the image file's bytes.",
            param="messages",
        ) from None
    try:
        return image_part(data)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}", param="messages") from None


def params(body: ChatCompletionCreate) -> dict[str, Any]:
    """The request params the body sets (omitted ones take the card's defaults)."""
    stop = [body.stop] if isinstance(body.stop, str) else body.stop
    raw = {
        "max_tokens": body.max_completion_tokens or body.max_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "stop": stop,
        "think": body.think,
        "seed": body.seed,
    }
    return {k: v for k, v in raw.items() if v is not None}


def usage(metrics: dict[str, Any]) -> Usage:
    prompt, completion = int(metrics["prompt_tokens"]), int(metrics["completion_tokens"])
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def completion(cid: str, created: int, model: str, text: str, metrics: dict[str, Any]) -> ChatCompletion:
    return ChatCompletion.model_validate(
        {
            "id": cid,
            "created": created,
            "model": model,
            "choices": [{"message": {"content": text}, "finish_reason": FINISH[metrics["stop_reason"]]}],
            "usage": usage(metrics),
        }
    )


async def sse(
    cid: str, created: int, model: str, deltas: AsyncIterator[Delta], include_usage: bool
) -> AsyncIterator[str]:
    """Server-sent events of a streamed completion: the role, each text delta, the finish reason, the
    usage when asked, then ``[DONE]``. ``deltas`` yields text, then the result's metrics (a dict)."""

    def event(delta: ChunkDelta, finish: str | None = None, with_usage: Usage | None = None) -> str:
        choices = [] if with_usage is not None else [ChunkChoice(delta=delta, finish_reason=finish)]  # type: ignore[arg-type]
        chunk = ChatCompletionChunk(id=cid, created=created, model=model, choices=choices, usage=with_usage)
        return f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"

    yield event(ChunkDelta(role="assistant", content=""))
    try:
        async for item in deltas:
            if isinstance(item, str):
                if item:
                    yield event(ChunkDelta(content=item))
                continue
            yield event(ChunkDelta(), FINISH[item["stop_reason"]])
            if include_usage:
                yield event(ChunkDelta(), with_usage=usage(item))
    except Exception as exc:  # failed mid-stream: the headers are sent, so the error is an event
        error = {
            "message": getattr(exc, "message", str(exc)),
            "type": "server_error",
            "code": getattr(exc, "code", None),
        }
        yield f"data: {json.dumps({'error': error})}\n\n"
        return
    yield "data: [DONE]\n\n"
