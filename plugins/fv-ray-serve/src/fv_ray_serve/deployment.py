"""One Ray Serve application per served model; each replica is a whole fv server for that model.

Why one ingress deployment per model rather than a router in front: each replica runs fv's own
FastAPI app (``create_app``) as its Serve ingress, so the OpenAI-compatible API is the one
``fv serve`` answers, with no second copy of it, no extra hop, no re-parsing of bodies (multipart
image uploads included) and mp4 downloads served straight from the replica. Each model scales on
its own queue. With one served model its application answers at ``/`` (``base_url=.../v1``);
with several, model ``m`` answers at ``/m`` (``base_url=.../m/v1``). Every replica of every model
shares one job store (``JobStore`` shared mode), so any replica reads, downloads, lists and deletes
(cancels) any job: the data dir's SQLite when every replica runs on one host, or the deploy file's
``store: postgresql://...`` with ``artifacts:`` on a shared folder or an S3 bucket when the Ray
cluster spans hosts (each node's ``data_dir`` then only stages files). Sessions stay on the replica that
opened them (``affinity.py``): their requests carry ``x-session-id: <id>`` and the deployment's request
router sends them there; ``GET /v1/sessions`` on any replica lists every replica's sessions.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from fv_core import DeploymentCard
from fv_core.deploy import parse_deploy
from fv_core.serving import create_app, default_data_dir
from fv_ray_serve.affinity import ROUTER, RayDirectory
from fv_ray_serve.autoscale import QUEUE_DEPTH
from fv_ray_serve.config import Fleet, ModelFleet, load_fleet_file


@serve.deployment
@serve.ingress()
class FvReplica:
    """An fv server (engine, job follower, the HTTP app) for one model, on the shared job store."""

    def __init__(self, deploy: dict[str, Any], data_dir: str, api_key: str | None, device: str) -> None:
        self._deploy, self._data_dir, self._api_key, self._device = deploy, data_dir, api_key, device
        context = serve.get_replica_context()
        # the job-owner id: unique for ever (a restarted replica is a new owner)
        self.replica_id = f"{context.deployment}-{context.replica_id.unique_id}-{uuid.uuid4().hex[:6]}"
        self.directory = RayDirectory(context.app_name, context.replica_id.unique_id)  # the fleet's sessions

    def __serve_build_asgi_app__(self) -> Any:
        deploy = parse_deploy(self._deploy, "fleet replica")
        return create_app(deploy, None, self._data_dir, self._api_key, self._device, replica=self.replica_id,
                          directory=self.directory)  # fmt: skip

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """This replica's queue depth, for ``QueueDepthPolicy``."""
        service = getattr(self.app.state, "service", None)  # type: ignore[attr-defined]
        return {QUEUE_DEPTH: float(service.queue_depth if service is not None else 0)}


def _options(deploy: DeploymentCard, name: str, scale: ModelFleet) -> dict[str, Any]:
    options: dict[str, Any] = {
        "name": name,
        "max_ongoing_requests": scale.max_ongoing_requests,
        "ray_actor_options": scale.ray_actor_options,
        # a stopping replica drains (the deploy's grace for in-flight jobs) before Ray kills it
        "graceful_shutdown_timeout_s": deploy.shutdown_grace_s + 10,
        # a session's requests (x-session-id) reach the replica holding its pages
        "request_router_config": RequestRouterConfig(request_router_class=ROUTER),
    }
    if scale.max_replicas_per_node is not None:
        options["max_replicas_per_node"] = scale.max_replicas_per_node
    if not scale.autoscaled:
        options["num_replicas"] = scale.replicas or 1
        return options
    options["autoscaling_config"] = {
        "min_replicas": scale.min_replicas,
        "max_replicas": scale.max_replicas,
        "initial_replicas": max(1, scale.min_replicas),
        "upscale_delay_s": scale.upscale_delay_s,
        "downscale_delay_s": scale.downscale_delay_s,
        "metrics_interval_s": 1.0,
        "look_back_period_s": 5.0,
        "policy": {
            "policy_function": "fv_ray_serve.autoscale:QueueDepthPolicy",
            "policy_kwargs": {"target_queue_depth": scale.target_queue_depth},
        },
    }
    return options


def applications(
    deploy: DeploymentCard,
    fleet: Fleet,
    data_dir: str | Path | None = None,
    api_key: str | None = None,
    device: str = "cpu",
    options: dict[str, Any] | None = None,
) -> list[tuple[str, Application, str]]:
    """(application name, application, route prefix) per served model; ``options`` override every
    deployment's Ray Serve options (a request router, say)."""
    root = str(Path(data_dir or deploy.data_dir or default_data_dir()).resolve())
    apps = []
    for model in deploy.models:
        name = model.served_name
        one = deploy.model_copy(update={"models": [model]}).model_dump(mode="json")
        replica = FvReplica.options(**{**_options(deploy, name, fleet.of(name)), **(options or {})})  # type: ignore[attr-defined]  # a Deployment at run time
        prefix = "/" if len(deploy.models) == 1 else f"/{name}"
        apps.append((name, replica.bind(one, root, api_key, device), prefix))
    return apps


def app_builder(args: dict[str, str]) -> Application:
    """For ``serve run fv_ray_serve:app_builder deploy=deploy.yaml [model=NAME] [data_dir=...]
    [api_key=...] [device=cpu]`` (or a Serve config's ``import_path``): one model's application."""
    deploy, fleet = load_fleet_file(args["deploy"])
    apps = {name: app for name, app, _ in applications(
        deploy, fleet, args.get("data_dir"), args.get("api_key"), args.get("device", "cpu")
    )}  # fmt: skip
    model = args.get("model") or (next(iter(apps)) if len(apps) == 1 else None)
    if model not in apps:
        raise ValueError(
            f"model={model!r}: the deploy file serves {sorted(apps)}; serve run runs one. "
            "Fix: pass model=NAME, or use fv serve --ray for all of them."
        )
    return apps[model]
