"""Session affinity: a session's requests and its socket reach the replica that holds its KV pages.

Each application has one session directory: fv's ``LocalDirectory`` run as a small Ray actor (named
``fv-sessions:<app>``, no CPU, outliving any replica), where every replica places the sessions it opens
and removes them when they end (``RayDirectory``). ``SessionRouter``, the deployment's Ray Serve request
router, reads it: a request carrying Serve's session header (``x-session-id: <session id>``) goes to the
replica that placed that session; when that replica is gone, to any other, which answers 410 (its socket:
an error event, ``session_lost``). Every other request goes to the less loaded of two random replicas
(Serve's default, without its preference for the proxy's node: sessions spread over the fleet).
"""

from __future__ import annotations

import random
from typing import Any

import ray
from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from fv_core.serving import LocalDirectory

NAMESPACE = "fv"
ROUTER = "fv_ray_serve.affinity:SessionRouter"


def directory_name(app: str) -> str:
    return f"fv-sessions:{app}"


def directory_actor(app: str) -> Any:
    """The application's directory actor (started by the first replica that asks)."""
    actor = ray.remote(LocalDirectory).options(  # type: ignore[attr-defined]
        name=directory_name(app), namespace=NAMESPACE, lifetime="detached", get_if_exists=True, num_cpus=0
    )
    return actor.remote()


class RayDirectory:
    """A replica's handle on its application's directory (fv_core's ``SessionDirectory``); placements
    carry the replica's Serve id (``ray_replica``) for the router."""

    def __init__(self, app: str, ray_replica: str) -> None:
        self.actor, self.ray_replica = directory_actor(app), ray_replica

    async def place(self, placement: dict[str, Any]) -> None:
        await self.actor.place.remote({**placement, "ray_replica": self.ray_replica})

    def remove(self, session_id: str) -> None:
        self.actor.remove.remote(session_id)

    async def where(self, session_id: str) -> dict[str, Any] | None:
        return await self.actor.where.remote(session_id)  # type: ignore[no-any-return]

    async def all(self) -> list[dict[str, Any]]:
        return await self.actor.all.remote()  # type: ignore[no-any-return]


class SessionRouter(FIFOMixin, RequestRouter):
    """Requests of a placed session to its replica; the rest to the less loaded of two random ones."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._actor: Any = None
        self._owners: dict[str, str] = {}  # session id -> Serve replica id (a session never moves)

    async def _owner(self, session_id: str) -> str | None:
        if session_id in self._owners:
            return self._owners[session_id]
        if self._actor is None:
            try:
                self._actor = ray.get_actor(directory_name(self._deployment_id.app_name), namespace=NAMESPACE)
            except ValueError:  # no replica placed a session yet
                return None
        placement = await self._actor.where.remote(session_id)
        if placement is None:
            return None
        if len(self._owners) > 100_000:
            self._owners.clear()
        self._owners[session_id] = placement["ray_replica"]
        return self._owners[session_id]

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        session_id = pending_request.metadata.session_id if pending_request is not None else ""
        owner = await self._owner(session_id) if session_id else None
        if owner is not None:
            mine = [r for r in candidate_replicas if r.replica_id.unique_id == owner]
            if mine:
                return [mine]
        return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
