"""Where sessions live: the directory of the sessions a server, or a whole fleet, holds.

A session's KV pages live on the replica that opened it, so its requests and its socket must reach that
replica. Each server places the sessions it opens in a ``SessionDirectory`` (a placement: id, model,
kind, the replica, ...) and removes them when they end. A lone server keeps its own (``LocalDirectory``);
a fleet shares one (fv-ray-serve's, which its request router also reads to send a session's requests to
its replica). ``GET /v1/sessions`` lists it; a session whose replica is gone is listed as lost.
"""

from __future__ import annotations

from typing import Any, Protocol


class SessionDirectory(Protocol):
    """Placements of open sessions by id."""

    async def place(self, placement: dict[str, Any]) -> None:
        """A session opened here: ``placement`` has at least ``id``, ``model``, ``kind`` and ``replica``."""

    def remove(self, session_id: str) -> None:
        """The session ended (closed, stopped, expired): it lives nowhere now (returns at once)."""

    async def where(self, session_id: str) -> dict[str, Any] | None:
        """The session's placement (None: not open anywhere)."""

    async def all(self) -> list[dict[str, Any]]:
        """Every placement."""


class LocalDirectory:
    """One server's sessions, in memory."""

    def __init__(self) -> None:
        self.placements: dict[str, dict[str, Any]] = {}

    async def place(self, placement: dict[str, Any]) -> None:
        self.placements[placement["id"]] = dict(placement)

    def remove(self, session_id: str) -> None:
        self.placements.pop(session_id, None)

    async def where(self, session_id: str) -> dict[str, Any] | None:
        return self.placements.get(session_id)

    async def all(self) -> list[dict[str, Any]]:
        return list(self.placements.values())
