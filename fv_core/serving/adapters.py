"""``/v1/adapters`` (fv's own, operators): add or remove a served model's LoRA adapters while it serves.

Adding reads and checks the file off the event loop; a name added again gets a new version (requests
already accepted finish on the one they named, later ones take the new one). Removing stops new
requests from naming it; running ones finish with it. ``GET /v1/models`` lists each model's adapters.
Like every ``/v1`` route these are behind the API key.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends, Request

from fv_core.errors import ConfigError
from fv_core.serving.errors import ApiError
from fv_core.serving.schemas import AdapterAdd
from fv_core.serving.service import Service


def _service(request: Request) -> Service:
    return request.app.state.service


def _plane(service: Service, model: str | None) -> tuple[str, Any]:
    served = service.model(model)
    plane = getattr(served.loaded.instance, "adapters", None)
    if plane is None:
        raise ApiError(
            400,
            f"model {served.name!r} takes no LoRA adapters (its card declares none). Fix: add adapters to a "
            "model that takes them (Wan, LTX-2).",
            "invalid_request",
            "model",
        )
    return served.name, plane


def router() -> APIRouter:
    router = APIRouter()

    @router.post("/adapters")
    async def add(body: AdapterAdd, service: Service = Depends(_service)) -> dict[str, Any]:
        name, plane = _plane(service, body.model)
        try:
            entry = await asyncio.to_thread(plane.add, body.name, body.path, body.scale, body.into)
        except ConfigError as exc:
            raise ApiError(400, str(exc), "invalid_adapter", "path") from None
        return {"model": name, **entry.describe()}

    @router.delete("/adapters/{model}/{adapter}")
    async def remove(model: str, adapter: str, service: Service = Depends(_service)) -> dict[str, Any]:
        name, plane = _plane(service, model)
        if not plane.remove(adapter):
            raise ApiError(
                404,
                f"model {name!r} serves no adapter {adapter!r} (it serves {sorted(plane.entries) or 'none'}). "
                "Fix: name one of those.",
                "adapter_not_found",
                "adapter",
            )
        return {"model": name, "name": adapter, "deleted": True}

    return router
