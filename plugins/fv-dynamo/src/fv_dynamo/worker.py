"""An fv server as a Dynamo worker: every served model registered with Dynamo's discovery, its requests
taken from Dynamo's request plane and run on the worker's own fv server.

The worker runs ``create_app`` (the app ``fv serve`` runs) on uvicorn in its own event loop, next to
Dynamo's runtime, and registers per served model ``m`` (component ``slug(m)`` in the namespace):

- ``videos`` (``ModelType.Videos``) when a task of ``m`` outputs video;
- ``generate`` (``ModelType.Images``, ``| ModelType.Chat`` when a task answers in text) when a task
  outputs images;
- ``routing``: not a model, a plain endpoint answering the model's routing card (``export``) as it is
  now, with the worker's ``load`` (predicted seconds of the work it holds), for routers and planners
  (``runtime.endpoint("NS.SLUG.routing").client()``; ``fv_dynamo.router.CostRouter`` routes by it).

Each workflow of the deploy file is registered the same way under its id (``videos`` or ``generate`` by
what its last stage makes, and ``routing``), so Dynamo's frontend lists and serves it like a model.
Each registration carries the routing card as it was at start in ``user_data["fv"]``. Dynamo's frontend
(``python -m dynamo.frontend``) then serves ``/v1/videos``, ``/v1/images/generations`` and
``/v1/chat/completions`` for the model. Discovery and the request plane are Dynamo's (``ETCD_ENDPOINTS``,
``NATS_SERVER``, ``DYN_REQUEST_PLANE``, ...).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from typing import Any

import httpx
import uvicorn
from dynamo.llm import ModelInput, ModelType, WorkerType, register_model

from fv_core import DeploymentCard
from fv_core.plugins import PluginHost
from fv_core.serving import create_app
from fv_dynamo.export import ROUTING_KEY, load, routing_card, workflow_card
from fv_dynamo.handlers import Handlers

log = logging.getLogger("fv.serving")


def slug(name: str) -> str:
    """A served name as a Dynamo component name (letters, digits, ``_`` and ``-``; a dot would split the
    endpoint path)."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", name)


async def serve_worker(
    runtime: Any,
    deploy: DeploymentCard,
    host: PluginHost | None = None,
    *,
    namespace: str = "fv",
    data_dir: str | None = None,
    api_key: str | None = None,
    device: str = "cpu",
    http_host: str = "127.0.0.1",
    http_port: int = 0,
    public_url: str | None = None,
    on_ready: Callable[[str], None] | None = None,
) -> None:
    """Serve ``deploy`` on ``runtime`` (a ``dynamo.runtime.DistributedRuntime``) until it shuts down or the
    fv server stops (SIGINT / SIGTERM: it drains first). The fv server listens on ``http_host:http_port``
    (0: a free port); ``public_url`` (default: that address) is where clients download videos answered
    as ``url``. ``on_ready(fv_url)`` is called once every model is registered."""
    app = create_app(deploy, host, data_dir, api_key, device)
    server = uvicorn.Server(uvicorn.Config(app, host=http_host, port=http_port, log_level="warning"))
    serving = asyncio.create_task(server.serve())
    while not server.started:
        if serving.done():
            serving.result()  # the app failed to start: its error
            raise RuntimeError("the fv server stopped before it started")
        await asyncio.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    url = f"http://{http_host}:{port}"
    auth = {"authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=url, headers=auth, timeout=None) as http:
        service = app.state.service
        served: list[tuple[Any, Any]] = []
        for name in [*service.models, *service.workflows]:
            served += await register(
                runtime, namespace, service, name, Handlers(http, name, public_url or url)
            )
        endpoints = asyncio.ensure_future(asyncio.gather(*(ep.serve_endpoint(h) for ep, h in served)))
        log.warning(
            "dynamo worker: %s in namespace %r, fv server at %s", sorted(service.models), namespace, url
        )
        if on_ready is not None:
            on_ready(url)
        await asyncio.wait({serving, endpoints}, return_when=asyncio.FIRST_COMPLETED)
        runtime.shutdown()
        server.should_exit = True
        await asyncio.gather(serving, endpoints, return_exceptions=True)


async def register(
    runtime: Any, namespace: str, service: Any, name: str, handlers: Handlers
) -> list[tuple[Any, Any]]:
    """Register served model (or workflow) ``name``'s endpoints with Dynamo; (endpoint, handler) to serve."""
    if name in service.models:
        outputs = {program.outputs[0] for program in service.models[name].loaded.card.programs.values()}
        card, path = routing_card(service, name), service.models[name].loaded.card.model_id
        describe = lambda: routing_card(service, name)  # noqa: E731
    else:
        card = workflow_card(service, name)
        outputs, path = {card["output"]}, name
        describe = lambda: card  # noqa: E731
    prefix = f"{namespace}.{slug(name)}"
    served = []

    async def routing(request: Any, context: Any) -> Any:
        yield {**describe(), "load": await load(service)}

    kinds = [(ModelType.Videos, "videos", handlers.videos)] if "video" in outputs else []
    if "image" in outputs:
        kind = ModelType.Images | ModelType.Chat if "text" in outputs else ModelType.Images
        kinds.append((kind, "generate", handlers.images_or_chat))
    if "text" in outputs and "image" not in outputs:  # Dynamo registers a Chat-only model from its HF folder
        log.warning("dynamo worker: %r answers only in text: not registered for chat (needs images)", name)
    for model_type, endpoint_name, handler in kinds:
        endpoint = runtime.endpoint(f"{prefix}.{endpoint_name}")
        await register_model(
            ModelInput.Text,
            model_type,
            endpoint,
            path,
            name,
            worker_type=WorkerType.Aggregated,  # a diffusion model runs whole on its worker
            needs=[],
            user_data={ROUTING_KEY: card},
        )
        served.append((endpoint, handler))
    served.append((runtime.endpoint(f"{prefix}.routing"), routing))
    return served
