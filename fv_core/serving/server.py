"""The uvicorn server ``fv serve`` runs: the first SIGTERM / Ctrl-C drains before exiting."""

from __future__ import annotations

import asyncio
import logging
import socket
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI

from fv_core.serving.service import Service

log = logging.getLogger("fv.serving")


class DrainingServer(uvicorn.Server):
    """On the first exit signal the service stops taking jobs (new ones answer 503 + Retry-After) while
    polls and downloads go on, in-flight jobs get the deploy's grace period, then the server exits; a
    second signal exits at once."""

    def __init__(self, app: FastAPI, **config: Any) -> None:
        super().__init__(uvicorn.Config(app, **config))
        self.app = app
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        service = getattr(self.app.state, "service", None) if self.started else None
        if self._draining or service is None or self._loop is None:
            super().handle_exit(sig, frame)
            return
        self._draining = True
        asyncio.run_coroutine_threadsafe(self._drain(service), self._loop)

    async def _drain(self, service: Service) -> None:
        grace = service.deploy.shutdown_grace_s
        log.warning("draining: new jobs answer 503; %d in flight get up to %g s", len(service.live), grace)
        await service.drain()
        self.should_exit = True
