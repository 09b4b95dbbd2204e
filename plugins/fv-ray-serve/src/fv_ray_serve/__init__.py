"""fv fleet: Ray Serve deployments of fv engines behind the OpenAI-compatible API.

Not an ``fv.plugins`` hook plugin (it registers nothing with the core): ``fv serve --ray`` imports it.
"""

from fv_ray_serve.autoscale import QUEUE_DEPTH, QueueDepthPolicy
from fv_ray_serve.config import Fleet, ModelFleet, load_fleet_file, split_fleet
from fv_ray_serve.deployment import FvReplica, app_builder, applications
from fv_ray_serve.run import run_fleet

__all__ = [
    "QUEUE_DEPTH",
    "Fleet",
    "FvReplica",
    "ModelFleet",
    "QueueDepthPolicy",
    "app_builder",
    "applications",
    "load_fleet_file",
    "run_fleet",
    "split_fleet",
]
