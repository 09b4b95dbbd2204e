"""``/v1/chat/completions``: OpenAI messages as a request's parts and prompt, and answers as OpenAI's
completion (or its server-sent chunks when ``stream`` is set).

A model's conversation has no roles (BAGEL's interleaved context): every message's texts and images
become the request's parts in order, and the last user text is its prompt. Images come as data URLs
(fv fetches nothing from the network).
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import AsyncIterator
from typing import Any

from fv_core.errors import ConfigError
from fv_core.request import Part, TextPart, image_part
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

DATA_URL = re.compile(r"^data:image/[\w.+-]+;base64,(?P<data>.*)$", re.DOTALL)
FINISH = {"eos": "stop", "stop": "stop", "max_tokens": "length"}  # the loop's stop reason -> OpenAI's


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
    cid: str, created: int, model: str, deltas: AsyncIterator[str | dict[str, Any]], include_usage: bool
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
