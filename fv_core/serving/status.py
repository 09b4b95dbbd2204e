"""What a server serves and how it is doing: ``/v1/models``, ``/health`` and Prometheus ``/metrics``."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request, Response

from fv_core.serving.metrics import CONTENT_TYPE, Metrics
from fv_core.serving.schemas import Model, ModelList
from fv_core.serving.service import Service


def _service(request: Request) -> Service:
    return request.app.state.service


def router() -> APIRouter:
    """``/models`` (under ``/v1``, behind the API key)."""
    router = APIRouter()

    @router.get("/models", response_model=ModelList)
    async def list_models(service: Service = Depends(_service)) -> ModelList:
        mode = service.deploy.determinism
        first = min((m.created for m in service.models.values()), default=0)
        return ModelList(
            data=[
                Model(id=m.name, created=m.created, determinism=mode, adapters=_adapters(m))
                for m in service.models.values()
            ]
            + [Model(id=w, created=first, determinism=mode, workflow=True) for w in service.workflows]
        )

    return router


def _adapters(served: Any) -> list[dict[str, Any]]:
    plane = getattr(served.loaded.instance, "adapters", None)
    return plane.describe() if plane is not None else []


def probes(metrics: Metrics, replica: str | None) -> APIRouter:
    """``/health`` and ``/metrics`` (open, for load balancers and Prometheus); a fleet replica's health
    names it."""
    router = APIRouter()

    @router.get("/health")
    async def health(request: Request) -> dict[str, Any]:
        service: Service = request.app.state.service
        health = {"status": "ok", "models": sorted(service.models), "running": len(service.live)}
        return health if replica is None else {**health, "replica": replica}

    @router.get("/metrics", response_class=Response)
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return router
