"""``/v1/sessions`` (fv's own): sessions of causal cards, where videos created with a ``session_id``
continue one video, each with its own prompt, from where the last one stopped."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from fv_core.errors import ConfigError
from fv_core.serving.bodies import read_body, validate
from fv_core.serving.errors import ApiError
from fv_core.serving.schemas import SessionCreate, SessionDeleted, SessionObject
from fv_core.serving.submission import Jobs


class Sessions(Jobs):
    """Sessions, opened on a served model and closed on whichever holds them."""

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


def _sessions(request: Request) -> Sessions:
    return request.app.state.service


def router() -> APIRouter:
    """The session routes."""
    router = APIRouter()

    @router.post("/sessions", response_model=SessionObject)
    async def open_session(request: Request, sessions: Sessions = Depends(_sessions)) -> SessionObject:
        """fv: open a session; videos created with its ``session_id`` continue one video, each with its
        own prompt, from where the last one stopped (causal cards)."""
        body = validate(SessionCreate, await read_body(request))
        model, sid = sessions.open_session(body.model, body.ttl_s)
        return SessionObject(id=sid, model=model)

    @router.delete("/sessions/{session_id}", response_model=SessionDeleted)
    async def close_session(session_id: str, sessions: Sessions = Depends(_sessions)) -> SessionDeleted:
        """fv: close a session and free its cache (a video continuing it fails at its next step)."""
        sessions.close_session(session_id)
        return SessionDeleted(id=session_id)

    return router
