"""One server's service: its resources' jobs (``Videos``, ``Images``, ``Chats``, ``Sessions``,
``Weights``, each in its module beside its routes) over the shared ``submission.Jobs``, and the
lifecycle that loads the models, starts the engine and drains on shutdown.
"""

from __future__ import annotations

import asyncio
import time

from fv_core.load import load
from fv_core.serving.chat import Chats
from fv_core.serving.images import Images
from fv_core.serving.sessions import Sessions
from fv_core.serving.submission import ServedModel
from fv_core.serving.videos import Videos
from fv_core.serving.weights import Weights


class Service(Videos, Images, Chats, Sessions, Weights):
    """Models, engine, job store and metrics of one server, and every resource's jobs on them."""

    _watchers: tuple[asyncio.Task[None], ...] = ()  # shared store only: following the other replicas

    async def start(self) -> None:
        """Load the models, start the engine, join the fleet's weights (a fleet replica), run again the
        queued jobs a stopped server kept, and on a shared store follow the other replicas."""
        self.models = await asyncio.to_thread(self._load_models)
        self.workflows = self.load_workflows()
        self.sweep()
        await self.engine.start()
        await self.join_fleet()
        self.requeue()
        watch = [self.watch_jobs(), self.watch_weights()] if self.store.shared else []
        self._watchers = tuple(asyncio.create_task(w) for w in watch)

    async def drain(self) -> None:
        """Stop taking jobs (new ones answer 503), end the real-time sessions (their sockets close with
        the reason) and give in-flight jobs the deploy's grace period."""
        self.draining = True
        await self.close_realtime("the server is shutting down")
        if self._tasks and self.deploy.shutdown_grace_s > 0:
            await asyncio.wait(self._tasks, timeout=self.deploy.shutdown_grace_s)

    async def stop(self) -> None:
        """Drain (unless a drain ran already), stop the engine (the jobs left fail with the reason) and let
        the job tasks record it."""
        if not self.draining:
            await self.drain()
        for watcher in self._watchers:
            watcher.cancel()
        await self.engine.stop()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=30)
        for served in self.models.values():
            served.loaded.close()  # a parallel model's worker processes exit

    def _load_models(self) -> dict[str, ServedModel]:
        """Every deployed model, loaded as ``fv_core.load(name, deploy=...)`` loads it."""
        now = int(time.time())
        return {
            m.served_name: ServedModel(
                m.served_name,
                m,
                load(m.served_name, deploy=self.deploy, device=self.device, host=self.host),
                now,
            )
            for m in self.deploy.models
        }
