"""Sessions of causal Wan: a video that goes on across requests (issue #21).

A session holds what the next chunk needs: its keys/values in the instance's KV pool (the rolling
window's frames), the latent frames made so far (the next chunk's absolute RoPE index) and the VAE
decoder's causal feature cache, and for a KV re-cache (``recache_on_prompt_change``) the window's clean
latents and the text its keys/values were made under. A request with ``session_id`` continues it with
its own prompt and seed; each chunk it finishes is committed to the session (so a request cancelled at a chunk boundary
leaves the session as of its last finished chunk, never half a chunk). One request at a time continues
a session; sessions share nothing but the pool (a request works on a fork of the session's pages).
A session is closed explicitly or after ``ttl_s`` idle seconds; either returns its pages.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch

from fv_core import ConfigError
from fv_core.adapters import adapter_tag
from fv_core.kv import KVSeq, PagedKVPool
from fv_core.loop import LoopState

DEFAULT_TTL_S = 600.0
MAX_TTL_S = 24 * 3600.0


@dataclass
class Session:
    id: str
    ttl_s: float
    used: float  # monotonic time of the last request's end (or the open)
    shape: dict[str, Any] | None = None  # the cache-shaping params the first request fixed
    seq: dict[str, Any] = field(default_factory=lambda: {"pages": [], "length": 0})  # its pages in the pool
    cache_frames: list[int] = field(default_factory=list)  # the latent frames the window holds
    frames: int = 0  # latent frames made so far
    vae_cache: list | None = None  # the decoder's feature cache after the last frame
    latents: torch.Tensor | None = None  # clean latents of the window's frames [1, C, frames, H, W]
    text: tuple | None = None  # the text its cached keys/values attended to (fv_wan.causal_recache.text_tag)
    reserved: int = 0  # pool pages reserved for the session's window
    busy: str | None = None  # the request continuing it now


# what a session's cache depends on, every continuation must match the first request's: its params, and
# the adapters its transformer ran (the cached keys/values were made with them)
PARAMS = ("height", "width", "chunk_frames", "window_frames", "sink_frames", "context_timestep", "flow_shift")
SHAPE = (*PARAMS, "adapters")


def session_shape(params: Any, state: LoopState) -> dict[str, Any]:
    """A request's :data:`SHAPE`: its params and its transformer adapters (names, versions, scales)."""
    return {**{k: getattr(params, k) for k in PARAMS}, "adapters": adapter_tag(state, "transformer")}


class Sessions:
    """One instance's open sessions over its KV pool."""

    def __init__(self, pool: PagedKVPool) -> None:
        self.pool = pool
        self._open: dict[str, Session] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._open)

    def open(self, ttl_s: float = DEFAULT_TTL_S) -> str:
        if not 0 < ttl_s <= MAX_TTL_S:
            raise ConfigError(
                f"ttl_s={ttl_s}: a session expires after 0 < ttl_s <= {MAX_TTL_S:.0f} idle seconds. "
                f"Fix: e.g. ttl_s={DEFAULT_TTL_S:.0f}",
                param="ttl_s",
            )
        self.expire()
        sid = f"sess_{uuid.uuid4().hex[:16]}"
        with self._lock:
            self._open[sid] = Session(sid, ttl_s, time.monotonic())
        return sid

    def close(self, sid: str) -> bool:
        """Close a session and return its pages; False if it is not open. A request continuing it ends
        at its next step with an error (its own pages are its own)."""
        with self._lock:
            session = self._open.pop(sid, None)
        if session is None:
            return False
        self._free(session)
        return True

    def expire(self, now: float | None = None) -> list[str]:
        """Close the sessions idle for longer than their ttl; returns their ids."""
        now = time.monotonic() if now is None else now
        with self._lock:
            gone = [s for s in self._open.values() if s.busy is None and now - s.used > s.ttl_s]
            for s in gone:
                del self._open[s.id]
        for s in gone:
            self._free(s)
        return [s.id for s in gone]

    def claim(self, sid: str, request_id: str, shape: dict[str, Any]) -> Session:
        """The session ``sid`` for ``request_id`` to continue (refused: unknown, busy, other shape)."""
        self.expire()
        with self._lock:
            session = self._open.get(sid)
            if session is None:
                raise ConfigError(
                    f"session_id={sid!r} is not open here (closed, expired or never opened). "
                    "Fix: open a session (POST /v1/sessions, LoadedModel.open_session) and use its id.",
                    param="session_id",
                )
            if session.busy is not None:
                raise ConfigError(
                    f"session {sid!r} is being continued by request {session.busy!r}; one request at a time "
                    "continues a session. Fix: wait for it to finish (or cancel it), then continue.",
                    param="session_id",
                )
            if session.shape is not None and session.shape != shape:
                differ = {
                    k: (shape[k], session.shape.get(k)) for k in SHAPE if shape[k] != session.shape.get(k)
                }
                raise ConfigError(
                    f"session {sid!r} was started with {session.shape}; this request changes "
                    f"{ {k: v[0] for k, v in differ.items()} }, which its cached frames cannot follow. "
                    f"Fix: send { {k: v[1] for k, v in differ.items()} } (or open a new session).",
                    param="session_id",
                )
            session.busy = request_id
            return session

    def _held(self, sid: str, request_id: str) -> Session:
        """The open session ``sid`` that ``request_id`` continues (it may have been closed meanwhile)."""
        with self._lock:
            session = self._open.get(sid)
        if session is None or session.busy != request_id:
            raise ConfigError(
                f"session {sid!r} was closed while request {request_id!r} continued it. Fix: open a new session.",
                param="session_id",
            )
        return session

    def commit(
        self, sid: str, request_id: str, seq: KVSeq, cache_frames: list[int], frames: int, vae_cache: list,
        shape: dict[str, Any], window_pages: int, latents: torch.Tensor, text: tuple,
    ) -> None:  # fmt: skip
        """A finished chunk: the session now holds ``seq``'s pages (a fork), window (its frames' clean
        ``latents`` and the ``text`` its keys/values attended to) and decoder cache."""
        session = self._held(sid, request_id)
        if session.reserved < window_pages:  # the session's pages outlive the request's reservation
            if not self.pool.reserve(window_pages - session.reserved):
                raise ConfigError(
                    f"the KV pool ({self.pool.num_pages} pages) has no {window_pages} pages free to keep "
                    f"session {session.id!r}'s window. Fix: close idle sessions or raise the card's causal_kv "
                    "budget.",
                    param="session_id",
                )
            session.reserved = window_pages
        old = KVSeq(**session.seq)
        kept = self.pool.fork(seq)
        session.seq = {"pages": list(kept.pages), "length": kept.length}
        self.pool.release(old)
        session.cache_frames, session.frames, session.vae_cache = list(cache_frames), frames, list(vae_cache)
        session.shape, session.latents, session.text = dict(shape), latents, text

    def release(self, sid: str, request_id: str) -> None:
        """The request continuing session ``sid`` ended (finished, cancelled or failed)."""
        with self._lock:
            session = self._open.get(sid)
            if session is not None and session.busy == request_id:
                session.busy = None
                session.used = time.monotonic()

    def _free(self, session: Session) -> None:
        self.pool.release(KVSeq(**session.seq))
        session.seq = {"pages": [], "length": 0}
        if session.reserved:
            self.pool.unreserve(session.reserved)
            session.reserved = 0
