"""``/v1/sessions`` (fv's own): sessions of causal cards, where videos created with a ``session_id``
continue one video, each with its own prompt, from where the last one stopped; and real-time sessions
(opened with ``fps``), made chunk by chunk at that frame rate while a client listens on
``/v1/sessions/{id}/ws`` (``ws.py``, ``realtime.py``). ``GET /v1/sessions`` lists where each lives
(``placement.py``): in a fleet, a session's requests carry ``x-session-id: <id>`` so they reach its
replica; one that reaches another answers 421 naming the replica, or 410 when that replica is gone."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request

from fv_core.errors import ConfigError
from fv_core.serving.bodies import read_body, validate
from fv_core.serving.errors import ApiError
from fv_core.serving.placement import LocalDirectory, SessionDirectory
from fv_core.serving.realtime import LINGER_S, RealtimeCollector, RealtimeSession, RealtimeSessions
from fv_core.serving.schemas import SessionCreate, SessionDeleted, SessionObject
from fv_core.serving.submission import Jobs

REALTIME_TTL_S = 24 * 3600.0  # a real-time session's own session never idles out: its linger ends it


class Sessions(Jobs):
    """Sessions, opened on a served model and closed on whichever holds them, placed in the directory."""

    @property
    def directory(self) -> SessionDirectory:
        """Where this server places its sessions: a fleet's shared directory (set by the app), else its own."""
        if "_directory" not in self.__dict__:
            self.__dict__["_directory"] = LocalDirectory()
        return self.__dict__["_directory"]

    @directory.setter
    def directory(self, directory: SessionDirectory) -> None:
        self.__dict__["_directory"] = directory

    @property
    def replica(self) -> str:
        """This server's id in placements (a fleet replica's id; the job store's owner id)."""
        return self.store.me

    async def placed(self, sid: str, model: str, kind: str, **more: Any) -> None:
        await self.directory.place({"id": sid, "model": model, "kind": kind, "replica": self.replica, **more})

    async def elsewhere(self, session_id: str) -> ApiError:
        """Why a session this server does not hold cannot be served here: 421 it lives on another live
        replica, 410 its replica is gone (its pages with it), 404 it is not open anywhere."""
        where = await self.directory.where(session_id)
        if where is None or where["replica"] == self.replica:
            return ApiError(404, f"no open session {session_id[:80]!r} (closed, expired or never opened). Fix: "
                            "open one with POST /v1/sessions.", "session_not_found", "session_id")  # fmt: skip
        if self.store.gone(where["replica"]):
            self.directory.remove(session_id)
            return ApiError(410, f"session {session_id[:80]!r} lived on replica {where['replica']!r}, which is "
                            "gone: its KV pages went with it. Fix: open a new session.", "session_lost",
                            "session_id")  # fmt: skip
        return ApiError(421, f"session {session_id[:80]!r} lives on replica {where['replica']!r}, not on this "
                        f"one ({self.replica!r}). Fix: send the header 'x-session-id: {session_id[:80]}' with "
                        "every request of the session (its socket too), so the fleet routes it there.",
                        "wrong_replica", "session_id")  # fmt: skip

    async def list_sessions(self) -> list[dict[str, Any]]:
        """Every placed session (the fleet's, on a shared directory) with its status: ``open``, or
        ``lost`` when its replica is gone; this server's real-time ones with their deadline record."""
        out = []
        for where in await self.directory.all():
            mine = where["replica"] == self.replica
            status = "open" if mine or not self.store.gone(where["replica"]) else "lost"
            live = self.realtime.get(where["id"]) if mine else None
            out.append({**where, "object": "session", "status": status, **(live.record() if live else {})})
        return out

    @property
    def realtime(self) -> RealtimeSessions:
        """This server's real-time sessions (made on first use; exported at ``/metrics``)."""
        if "_realtime" not in self.__dict__:
            self.__dict__["_realtime"] = RealtimeSessions(self.engine)
            self.metrics.registry.register(RealtimeCollector(self.__dict__["_realtime"]))
        return self.__dict__["_realtime"]

    def open_session(self, model: str | None, ttl_s: float | None) -> tuple[str, str]:
        """(served model name, the new session's id); a model without sessions is a 400."""
        served = self.model(model)
        try:
            sid = served.loaded.open_session(ttl_s)
        except ConfigError as exc:
            raise ApiError(400, str(exc), "unsupported_model" if exc.param is None else "invalid_request",
                           exc.param or "model") from None  # fmt: skip
        return served.name, sid

    async def open_realtime(self, body: SessionCreate) -> SessionObject:
        """A real-time session: its params checked (400), its deadlines admitted against the sessions held
        (429 with the predicted numbers)."""
        assert body.fps is not None, "a real-time session has an fps"
        self.check_taking_jobs()
        model, sid = self.open_session(body.model, REALTIME_TTL_S)
        served = self.model(model)
        params: dict[str, Any] = {**(body.params or {}), "prompt": body.prompt or "", "seed": body.seed or 0}
        session = RealtimeSession(
            sid, model, served.loaded, self.engine, body.fps, params, body.linger_s or LINGER_S
        )
        try:
            served.loaded.prepare(session.chunk_params(0), request_id=f"{sid}-check")
            predicted = self.realtime.admit(session)
        except ConfigError as exc:
            served.loaded.close_session(sid)
            if exc.param != "fps":
                raise ApiError(400, str(exc), "invalid_request", exc.param) from None
            self.metrics.refusals.labels("deadline").inc()
            raise ApiError(429, str(exc), "deadline_infeasible", "fps") from None
        await self.placed(sid, model, "realtime", fps=body.fps)
        ended = session.on_end

        def on_end(s: RealtimeSession) -> None:
            ended(s)
            self.directory.remove(s.id)

        session.on_end = on_end
        return SessionObject(id=sid, model=model, fps=body.fps, predicted=predicted, replica=self.replica)

    async def session_record(self, session_id: str) -> dict[str, Any]:
        """A real-time session's record: its deadline misses, chunk latency, achieved fps, ..."""
        session = self.realtime.get(session_id)
        if session is None:
            refusal = await self.elsewhere(session_id)
            if refusal.status != 404:
                raise refusal
            raise ApiError(404, f"no real-time session {session_id[:80]!r} (closed, ended or never opened with "
                           "fps). Fix: open one with POST /v1/sessions and an fps.", "session_not_found",
                           "session_id")  # fmt: skip
        return {**session.record(), "replica": self.replica}

    async def close_realtime(self, reason: str) -> None:
        """End every real-time session (shutdown): each socket gets the end and closes with 1001, the
        pages return."""
        if "_realtime" in self.__dict__:
            await self.realtime.close_all(reason)

    async def close_session(self, session_id: str) -> None:
        """Close a session on whichever served model holds it; unknown ids are a 404."""
        if await self.realtime.close(session_id, "closed by DELETE /v1/sessions"):
            return
        if not any(served.loaded.close_session(session_id) for served in self.models.values()):
            raise await self.elsewhere(session_id)
        self.directory.remove(session_id)


def _sessions(request: Request) -> Sessions:
    return request.app.state.service


def router() -> APIRouter:
    """The session routes."""
    router = APIRouter()

    @router.post("/sessions", response_model=SessionObject)
    async def open_session(request: Request, sessions: Sessions = Depends(_sessions)) -> SessionObject:
        """fv: open a session; videos created with its ``session_id`` continue one video, each with its
        own prompt, from where the last one stopped (causal cards). With ``fps``: a real-time session,
        made chunk by chunk while a client listens on ``/v1/sessions/{id}/ws`` (429 when the instance
        cannot meet its deadlines beside the sessions it holds)."""
        body = validate(SessionCreate, await read_body(request))
        if body.fps is not None:
            return await sessions.open_realtime(body)
        model, sid = sessions.open_session(body.model, body.ttl_s)
        await sessions.placed(sid, model, "continuation", ttl_s=body.ttl_s)
        return SessionObject(id=sid, model=model, replica=sessions.replica)

    @router.get("/sessions")
    async def list_sessions(sessions: Sessions = Depends(_sessions)) -> dict[str, Any]:
        """fv: every open session and where it lives (``replica``; in a fleet, all replicas' sessions),
        ``status`` open or lost (its replica is gone); real-time ones here with their deadline record."""
        return {"object": "list", "data": await sessions.list_sessions()}

    @router.get("/sessions/{session_id}")
    async def session_record(session_id: str, sessions: Sessions = Depends(_sessions)) -> dict[str, Any]:
        """fv: a real-time session's record (deadline misses, chunk latency, achieved fps, KV bytes)."""
        return await sessions.session_record(session_id)

    @router.delete("/sessions/{session_id}", response_model=SessionDeleted)
    async def close_session(session_id: str, sessions: Sessions = Depends(_sessions)) -> SessionDeleted:
        """fv: close a session and free its cache (a video continuing it fails at its next step)."""
        await sessions.close_session(session_id)
        return SessionDeleted(id=session_id)

    return router
