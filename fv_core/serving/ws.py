"""``/v1/sessions/{id}/ws``: a real-time session over a WebSocket (``realtime.py``).

Connect with ``?format=png|h264`` (each chunk's frames as base64 PNGs, or one base64 H.264 mp4 fragment
of them), ``policy=drop|pause`` (a slow client: keep only the newest chunk, or pause the session) and
``window=N`` (chunks sent and not acknowledged at most; 0, the default: no acknowledgements). With an
API key, send ``Authorization: Bearer <key>``.

Server messages (JSON text): ``{"type": "session", ...the session record, "format", "policy",
"window"}`` first; a reconnect then gets the last committed chunk again and the session goes on from
it; ``{"type": "chunk", "chunk", "first_frame", "frames", "prompt", "strength", "recache", "latency_s",
"deadline_missed", "format", "data"}`` per chunk; ``{"type": "error", "message"}`` for a bad message;
``{"type": "error", "message", "code"}`` then a close for a session this replica does not hold (code
``wrong_replica``: connect with ``x-session-id: <id>``; ``session_lost``: its replica is gone, close
code 1011); ``{"type": "end", "reason", ...the record}`` when the session ends; then the socket closes with that
reason, code 1000, or 1001 when the server shuts down (every session is ended and its pages freed).

Client messages: ``{"type": "steer", "prompt"?, "strength"?, "recache"?}`` (from the next chunk on: the
new prompt, how strongly it applies against the one before, 0 < strength <= 1, and whether a chunk
under a new prompt first re-caches the window under it: ``recache_on_prompt_change``), ``{"type": "ack"}``
(one chunk taken), ``{"type": "stop"}`` (end the session; its KV pages return). A client that goes
away leaves the session paused for its ``linger_s``, then it ends.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import secrets
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from fastapi import APIRouter, WebSocket, WebSocketDisconnect

from fv_core.artifacts import to_uint8
from fv_core.errors import ConfigError
from fv_core.serving.media import encode_png
from fv_core.serving.realtime import Chunk, Listener, RealtimeSession

FORMATS = ("png", "h264")
POLICIES = ("drop", "pause")
MAX_WINDOW = 64


def encode(chunk: Chunk, fmt: str, fps: float) -> str | list[str]:
    """A chunk's frames as base64 PNGs, or as one base64 mp4 (H.264, fragmented, no lookahead)."""
    if fmt == "png":
        return [base64.b64encode(encode_png(f)).decode() for f in chunk.frames]
    return base64.b64encode(h264(chunk.frames, fps)).decode()


def h264(frames: np.ndarray, fps: float) -> bytes:
    """Frames ``[F, H, W, 3]`` in 0..1 as a self-contained fragmented mp4 (H.264)."""
    import imageio.v2 as imageio

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "chunk.mp4"
        imageio.mimwrite(
            path, list(to_uint8(frames)), fps=fps, codec="libx264", quality=8, macro_block_size=1,
            output_params=["-tune", "zerolatency", "-movflags", "frag_keyframe+empty_moov+default_base_moof"],
        )  # fmt: skip
        return path.read_bytes()


def connection_error(params: dict[str, str]) -> str | None:
    """What is wrong with the connection's query params (value, rule, fix), or None."""
    fmt, policy, window = params.get("format", "png"), params.get("policy", "drop"), params.get("window", "0")
    if fmt not in FORMATS:
        return f"format={fmt!r} is not one of {list(FORMATS)}. Fix: ?format=png or ?format=h264"
    if policy not in POLICIES:
        return f"policy={policy!r} is not one of {list(POLICIES)}. Fix: ?policy=drop or ?policy=pause"
    if not window.isdigit() or int(window) > MAX_WINDOW:
        return f"window={window!r} must be a whole number 0..{MAX_WINDOW}. Fix: e.g. ?window=2 (0: no acks)"
    return None


def chunk_message(chunk: Chunk, fmt: str, data: Any) -> str:
    return json.dumps(
        {
            "type": "chunk",
            "chunk": chunk.index,
            "first_frame": chunk.first_frame,
            "frames": len(chunk.frames),
            "prompt": chunk.prompt,
            "strength": chunk.strength,
            "steer_from": chunk.steer_from,
            "recache": chunk.recache,
            "latency_s": chunk.latency_s,
            "deadline_missed": chunk.missed,
            "format": fmt,
            "data": data,
        }  # fmt: skip
    )


async def send_chunks(ws: WebSocket, session: RealtimeSession, listener: Listener, fmt: str) -> None:
    """The listener's chunks as they come (encoded here, off the event loop), then the end."""
    while (chunk := await listener.next()) is not None:
        data = await asyncio.to_thread(encode, chunk, fmt, session.fps)
        await ws.send_text(chunk_message(chunk, fmt, data))
    taken = session.listener not in (listener, None)
    reason = "another connection took this session over" if taken else session.closed
    try:
        await ws.send_text(json.dumps({"type": "end", **session.record(), "reason": reason}))
        await ws.close(1000 if taken else session.close_code, str(reason)[:120])
    finally:
        listener.finished.set()


async def handle(ws: WebSocket, session: RealtimeSession, listener: Listener, text: str, close: Any) -> bool:
    """One client message; False once the client stopped the session."""
    with contextlib.suppress(ValueError):
        message: Any = text
        message = json.loads(text)
    kind = message.get("type") if isinstance(message, dict) else None
    if kind == "ack":
        listener.ack()
    elif kind == "steer":
        try:
            session.steer(message.get("prompt"), message.get("strength"), message.get("recache"))
        except ConfigError as exc:
            await ws.send_text(json.dumps({"type": "error", "message": str(exc)}))
    elif kind == "stop":
        await close(session.id, "stopped by the client")
        return False
    else:
        await ws.send_text(json.dumps({"type": "error", "message": (
            f"message {str(message)[:200]!r} is not one of steer / ack / stop. Fix: send e.g. "
            '{"type": "steer", "prompt": "a red circle", "strength": 1}')}))  # fmt: skip
    return True


def router(api_key: str | None) -> APIRouter:
    """The WebSocket route (its own key check: browsers' sockets carry no HTTP dependency)."""
    router = APIRouter()

    @router.websocket("/sessions/{session_id}/ws")
    async def session_socket(ws: WebSocket, session_id: str) -> None:
        await ws.accept()
        given = ws.headers.get("authorization", "").removeprefix("Bearer ")
        code: str | None = None
        problem = connection_error(dict(ws.query_params))
        service = ws.app.state.service
        session = service.realtime.get(session_id)
        if api_key is not None and not secrets.compare_digest(given.encode(), api_key.encode()):
            problem = (
                "missing or incorrect API key. Fix: send 'Authorization: Bearer <key>' with the server's key."
            )
        elif problem is None and session is None:
            problem = (f"no real-time session {session_id[:80]!r} (closed, ended or never opened with fps). "
                       "Fix: open one with POST /v1/sessions and an fps.")  # fmt: skip
            elsewhere = await service.elsewhere(session_id)  # another replica's, or a gone one's
            code = {410: "session_lost", 421: "wrong_replica"}.get(elsewhere.status)
            problem = elsewhere.message if code else problem
        if problem is not None:
            await ws.send_text(json.dumps({"type": "error", "message": problem, "code": code}))
            await ws.close(code=1011 if code == "session_lost" else 1008, reason=(code or "refused"))
            return
        fmt = ws.query_params.get("format", "png")
        listener = Listener(ws.query_params.get("policy", "drop"), int(ws.query_params.get("window", "0")))  # type: ignore[arg-type]
        hello = {"type": "session", **session.record(), "replica": service.replica, "format": fmt,
                 "policy": listener.policy}  # fmt: skip
        if session.last is not None:  # a reconnect resumes at the last committed chunk (the hello's)
            listener.offer(session.last)
        session.attach(listener)
        await ws.send_text(json.dumps({**hello, "window": listener.window}))
        sender = asyncio.create_task(send_chunks(ws, session, listener, fmt))
        try:
            while await handle(ws, session, listener, await ws.receive_text(), service.realtime.close):
                pass
            await sender
        except (WebSocketDisconnect, RuntimeError):
            pass
        finally:
            session.detach(listener)
            sender.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await sender

    return router
