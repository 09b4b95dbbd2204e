"""``POST /v1/weights`` (fv's own): a trainer's weights put live while the server serves.

A ``WeightSyncPlan`` (JSON) and a safetensors file (see ``fv_core.training.sync``) are checked and staged
off the engine's thread, then swapped in between two of its ticks: requests accepted before finish on
the weights they started with, those after run on the new ones. On a shared store (a fleet) the push
is logged (``weight_log``) and every replica applies the fleet's syncs in the log's order.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from fastapi import APIRouter, Depends, File, Form, Request
from fastapi import UploadFile as UploadedFile
from pydantic import ValidationError

from fv_core.deploy.card import DeploymentCard
from fv_core.errors import ConfigError, WeightsError, explain
from fv_core.plugins import PluginHost
from fv_core.serving.errors import ApiError
from fv_core.serving.jobs import JobStore
from fv_core.serving.metrics import Metrics
from fv_core.serving.schemas import WeightsSynced
from fv_core.serving.submission import RECOVER_S, WATCH_S, Jobs, ServedModel
from fv_core.serving.weight_log import WeightLog, tensor_names

if TYPE_CHECKING:
    from fv_core.training.sync import SyncResult, WeightSyncPlan

log = logging.getLogger("fv.serving")
FLEET_SYNC_WAIT_S = 30.0  # a fleet's weight sync answers once every replica applied it, or after this


class Weights(Jobs):
    """Weight syncs: one at a time, each staged on the live weights; in a fleet, in the log's order."""

    def __init__(
        self, deploy: DeploymentCard, host: PluginHost, store: JobStore, metrics: Metrics, device: str = "cpu"
    ) -> None:
        super().__init__(deploy, host, store, metrics, device)
        self._sync_lock = asyncio.Lock()  # one weight sync at a time (each stages on the live weights)
        self._weights = WeightLog(store) if store.shared else None  # a fleet's weight syncs
        self._weights_seq = 0  # the last of them this replica applied

    async def join_fleet(self) -> None:
        """A fleet replica takes jobs on the fleet's weights: pushes from now on wait for it too, and it
        applies the syncs it lacks (a no-op on a lone server)."""
        if self._weights is None:
            return
        for name, served in self.models.items():
            self._weights.applied(name, 0)
            self._weights.taken(name, served.loaded.instance.weights_versions)  # never a push's
        async with self._sync_lock:
            await self._catch_up()

    async def watch_weights(self) -> None:
        """Shared store: apply the weight syncs other replicas received; after one failed here, try
        again every ``RECOVER_S``."""
        retry = 0.0
        while True:
            await asyncio.sleep(WATCH_S)
            if self._weights is None or time.monotonic() < retry or self._sync_lock.locked():
                continue
            try:
                async with self._sync_lock:
                    await self._catch_up()
            except Exception:  # recorded for the pusher; later syncs wait behind it
                log.exception("applying the fleet's weight sync after %d failed", self._weights_seq)
                retry = time.monotonic() + RECOVER_S

    async def sync_weights(self, model: str | None, plan_json: str, weights: bytes) -> WeightsSynced:
        """Put a trainer's weights live (``fv_core.training.sync``): checked and staged off the engine's
        thread while generation goes on, swapped in between two of its ticks. Jobs accepted before
        finish on the weights they started with; bad plans and tensors answer 400, version clashes
        409, and change nothing. A fleet replica puts it live on every replica (``weight_log``) and
        answers once they all applied it, or after ``FLEET_SYNC_WAIT_S``."""
        from fv_core.training.sync import WeightSyncPlan

        served = self.model(model)
        try:
            plan = WeightSyncPlan.model_validate_json(plan_json)
        except ValidationError as exc:
            message = explain(exc, "weight sync plan", WeightSyncPlan.model_fields)
            raise ApiError(400, message, "invalid_plan", "plan") from None
        work = asyncio.ensure_future(self._sync(served, plan, weights))
        try:
            result, seq = await asyncio.shield(work)  # a caller that goes away never stops a swap midway
        except asyncio.CancelledError:
            work.add_done_callback(_log_unheard)
            raise
        except WeightsError as exc:
            raise ApiError(400, str(exc), "invalid_weights", "weights") from None
        except ConfigError as exc:
            if exc.param == "version":
                raise ApiError(409, str(exc), "version_conflict", "plan") from None
            raise ApiError(400, str(exc), "invalid_plan", "plan") from None
        log.info(
            "weights of %s synced: %s (role %s; %d cache entries dropped; %d requests finish on the previous)",
            served.name, result.versions, result.role, result.cache_entries_dropped, len(result.pinned),
        )  # fmt: skip
        fleet_seq, behind, errors = None, list[str](), dict[str, str]()
        if self._weights is not None:
            fleet_seq = seq
            behind, errors = await self._fleet_caught_up(served.name, seq)
            try:
                self._weights.compact(served.name)
            except Exception:  # the log stays longer; the next push compacts it
                log.exception("compacting the fleet's weight log failed")
        return WeightsSynced(
            model=served.name,
            role=result.role,
            versions=result.versions,
            previous=result.previous,
            tensors=result.tensors,
            cache_entries_dropped=result.cache_entries_dropped,
            requests_on_previous=len(result.pinned),
            fleet_seq=fleet_seq,
            replicas_behind=behind,
            replica_errors=errors,
        )

    async def _sync(
        self, served: ServedModel, plan: WeightSyncPlan, weights: bytes
    ) -> tuple[SyncResult, int]:
        """A push, one at a time: (what it did, its seq in a fleet's log; 0 on a lone server)."""
        async with self._sync_lock:
            if self._weights is None:
                return await self._apply(served, plan, weights), 0
            async with self._weights.lock():
                return await self._fleet_push(served, plan, weights)

    async def _apply(self, served: ServedModel, plan: WeightSyncPlan, weights: bytes) -> SyncResult:
        """Stage ``weights`` off the engine's thread, then swap them in at its next step boundary."""
        from fv_core.training.sync import stage_sync

        staged = await asyncio.to_thread(stage_sync, served.loaded, plan, weights)
        return await asyncio.wrap_future(self.engine.at_boundary(staged.apply))

    async def _fleet_push(
        self, served: ServedModel, plan: WeightSyncPlan, weights: bytes
    ) -> tuple[SyncResult, int]:
        """A push this fleet replica received (under the fleet's sync lock): on the fleet's weights,
        checked, logged pending, put live here, then settled for the others."""
        from fv_core.training.sync import stage_sync

        assert self._weights is not None
        try:
            await self._catch_up()
        except Exception as exc:
            raise ApiError(
                503,
                f"this replica cannot apply the fleet's earlier weight syncs ({exc}), so it cannot check "
                "this one against the fleet's weights. Fix: push again (through another replica).",
                "replica_behind",
            ) from None
        self._weights.check_new(served.name, plan.components, plan.version)
        staged = await asyncio.to_thread(stage_sync, served.loaded, plan, weights)  # 400 / 409 here
        path = await asyncio.to_thread(self._weights.write, weights)
        sync = self._weights.publish(served.name, plan.model_dump_json(), path, tensor_names(weights))
        try:
            result = await asyncio.wrap_future(self.engine.at_boundary(staged.apply))
        except BaseException:
            self._weights.withdraw(sync)
            raise
        self._weights.settle(sync, result.versions)
        self._weights_seq = sync.seq
        self._weights.applied(served.name, sync.seq)
        return result, sync.seq

    async def _catch_up(self) -> None:
        """Apply the fleet's settled syncs this replica lacks, oldest first (the caller holds
        ``_sync_lock``). One that fails here is recorded and raised; the later ones wait behind it, so
        a replica never runs weights out of the fleet's order. One already live (its versions are the
        live ones: versions are never reused) only advances the count."""
        from fv_core.training.sync import WeightSyncPlan

        assert self._weights is not None
        pending = self._weights.after(self._weights_seq, list(self.models))
        while pending:
            sync = pending.pop(0)
            try:
                payload = await asyncio.to_thread(self._weights.read, sync)
            except FileNotFoundError:  # compacted (this replica is starting): list the rest again
                pending = self._weights.after(self._weights_seq, list(self.models))
                if pending and pending[0].seq == sync.seq:  # still logged: its payload went missing
                    self._weights.failed(sync, f"its payload {str(sync.path)!r} is missing")
                    raise
                continue
            except OSError as exc:
                self._weights.failed(sync, f"reading its payload: {exc}")
                raise
            try:
                plan, served = WeightSyncPlan.model_validate_json(sync.plan), self.models[sync.model]
                live = served.loaded.instance.weights_versions
                if any(live.get(component) != plan.version for component in plan.components):
                    await self._apply(served, plan, payload)
            except Exception as exc:
                self._weights.failed(sync, f"{type(exc).__name__}: {exc}")
                raise
            self._weights_seq = sync.seq
            self._weights.applied(sync.model, sync.seq)

    async def _fleet_caught_up(self, model: str, seq: int) -> tuple[list[str], dict[str, str]]:
        """Wait (up to ``FLEET_SYNC_WAIT_S``) until every live replica of ``model`` applied ``seq``: the
        replicas still behind, and why the sync failed on others."""
        assert self._weights is not None
        deadline = time.monotonic() + FLEET_SYNC_WAIT_S
        while (behind := self._weights.behind(model, seq)) and time.monotonic() < deadline:
            await asyncio.sleep(WATCH_S)
        return behind, self._weights.failures(model, seq)


def _log_unheard(push: asyncio.Future[tuple[SyncResult, int]]) -> None:
    """A weight push whose caller went away: log how it ended, since nobody hears the answer."""
    if push.cancelled():
        log.warning("a weight push whose caller went away was cancelled (the server stopped)")
    elif (error := push.exception()) is not None:
        log.warning("a weight push whose caller went away failed: %s", error)
    else:
        log.info("a weight push whose caller went away is live: %s", push.result()[0].versions)


def _weights(request: Request) -> Weights:
    return request.app.state.service


def router() -> APIRouter:
    """The weight sync route."""
    router = APIRouter()

    @router.post("/weights", response_model=WeightsSynced)
    async def sync_weights(
        plan: str = Form(description='the WeightSyncPlan as JSON: {"role", "components", "version"}'),
        weights: UploadedFile = File(description="safetensors of the tensors, keyed '<component>.<name>'"),
        model: str | None = Form(None, description="served model name; default: the first deployed"),
        service: Weights = Depends(_weights),
    ) -> WeightsSynced:
        """Hot weight sync from a trainer (``fv_core.training.push_weights``): requests accepted before
        it finish on the weights they started with, those after run on the new ones."""
        return await service.sync_weights(model, plan, await weights.read())

    return router
