"""The FastAPI app: OpenAI-shaped video, image and chat endpoints, fv's sessions and weight sync, models,
health and metrics; one router per resource (``videos``, ``images``, ``chat``, ``sessions``,
``weights``, ``status``), every ``/v1`` route behind the API key.

Every error is answered as ``{"error": {message, type, param, code}}`` (``errors``):
400 bad or over-limit input and schema violations (as OpenAI answers them), 401 bad API key,
404 unknown model or video, 409 content not ready or a weights version clash, 413 body too large,
429 full queue (Retry-After). ``POST /v1/weights`` (fv's own) takes a trainer's weights: a
``WeightSyncPlan`` as JSON and a safetensors file (see ``fv_core.training.sync``).
OpenAI fields fv does not use (``user``, ``quality``, ...) are accepted and ignored, and named in
the ``x-fv-ignored-fields`` response header.
Unexpected failures answer 500 without a stack trace.
"""

from __future__ import annotations

import logging
import secrets
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel

from fv_core.deploy.card import DeploymentCard
from fv_core.load import checkpoint_card
from fv_core.plugins import PluginHost, load_plugins
from fv_core.registry import resolve_lazy
from fv_core.serving import adapters, chat, images, sessions, status, videos, weights, ws
from fv_core.serving.errors import ApiError, add_error_handlers
from fv_core.serving.jobs import JobStore, default_data_dir
from fv_core.serving.metrics import Metrics
from fv_core.serving.placement import SessionDirectory
from fv_core.serving.schemas import ErrorBody, ImageBase, ImageEditBase, VideoBase, with_params
from fv_core.serving.service import Service

log = logging.getLogger("fv.serving")
ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody} for code in (400, 401, 404, 409, 413, 429)
}


def create_app(
    deploy: DeploymentCard,
    host: PluginHost | None = None,
    data_dir: str | Path | None = None,
    api_key: str | None = None,
    device: str = "cpu",
    replica: str | None = None,
    directory: SessionDirectory | None = None,
) -> FastAPI:
    """An app serving ``deploy``; models load and the engine starts in its lifespan.

    ``replica`` (a fleet replica's unique id) opens the data dir's job store in shared mode, so
    several replicas serve one job table (see ``JobStore``); answers then carry ``x-fv-replica``.
    ``directory`` is the fleet's shared ``SessionDirectory`` (where each session lives).

    The request bodies (and so the OpenAPI schema) are OpenAI's fields plus the request params
    of the deployed cards' tasks, from their loops' Params."""
    metrics = Metrics()
    plugins = host if host is not None else load_plugins()
    params = _served_params(deploy, plugins)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        root = data_dir or deploy.data_dir or default_data_dir()
        store = JobStore(root, deploy.retention.max_age_s, replica, deploy.store, deploy.artifacts)
        service = Service(deploy, plugins, store, metrics, device)
        if directory is not None:
            service.directory = directory
        try:
            await service.start()
            app.state.service = service
            yield
        finally:
            await service.stop()
            store.close()

    app = FastAPI(title="fv", summary="OpenAI-compatible video and image generation", lifespan=lifespan)
    add_error_handlers(app)

    @app.middleware("http")
    async def request_id(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        """Every answer carries ``x-request-id``: the client's own, else a new one; logs name it."""
        rid = request.headers.get("x-request-id", "")[:128] or uuid.uuid4().hex
        request.state.request_id = rid
        response = await call_next(request)
        response.headers["x-request-id"] = rid
        if replica is not None:
            response.headers["x-fv-replica"] = replica
        log.info("%s %s -> %s [request %s]", request.method, request.url.path, response.status_code, rid)
        return response

    v1 = APIRouter(dependencies=[Depends(_authorize(api_key))], responses=ERRORS)
    v1.include_router(videos.router(with_params(VideoBase, params, "VideoCreate")))
    v1.include_router(
        images.router(
            with_params(ImageBase, params, "ImageCreate"), with_params(ImageEditBase, params, "ImageEdit")
        )
    )
    v1.include_router(chat.router())
    v1.include_router(sessions.router())
    v1.include_router(weights.router())
    v1.include_router(adapters.router())
    v1.include_router(status.router())
    app.include_router(v1, prefix="/v1")
    app.include_router(ws.router(api_key), prefix="/v1")  # the key is checked on the socket
    app.include_router(status.probes(metrics, replica))
    return app


def _authorize(api_key: str | None) -> Callable[[HTTPAuthorizationCredentials | None], None]:
    """The ``/v1`` dependency: without ``api_key`` anyone; with one, ``Authorization: Bearer <key>``."""
    bearer = HTTPBearer(auto_error=False)

    def authorize(creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        if api_key is None:
            return
        if creds is None or not secrets.compare_digest(creds.credentials.encode(), api_key.encode()):
            raise ApiError(
                401,
                "missing or incorrect API key. Fix: send 'Authorization: Bearer <key>' with the server's key.",
                "invalid_api_key",
            )

    return authorize


def _served_params(deploy: DeploymentCard, host: PluginHost) -> list[type[BaseModel]]:
    """The Params classes of every task of every deployed card (cards that fail to assemble add none:
    loading reports them)."""
    classes: list[type[BaseModel]] = []
    for m in deploy.models:
        try:
            card = host.card(m.card) if m.card in host.registries.cards else checkpoint_card(host, m.card)[0]
        except Exception:
            continue
        for task in card.programs:
            cls = resolve_lazy(card.params_of(task))
            if cls not in classes:
                classes.append(cls)
    return classes
