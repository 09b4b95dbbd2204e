"""Autoscaling on queue depth.

A video request answers at once with a queued job, so Ray Serve's own signal (ongoing HTTP
requests) stays near zero however deep the queue is. Each replica therefore reports its own queue
depth (video jobs accepted and not finished, and images synchronous requests wait for) through ``record_autoscaling_stats``, and this policy
sizes the deployment from it; Ray applies min/max replicas and the up/downscale delays around it.
"""

from __future__ import annotations

import math
from typing import Any

QUEUE_DEPTH = "fv_unfinished_jobs"  # the custom metric each replica reports


class QueueDepthPolicy:
    """Replicas = ceil((jobs on all replicas + HTTP requests waiting for a replica) / target)."""

    def __init__(self, target_queue_depth: float) -> None:
        self.target = target_queue_depth

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        depths = (ctx.aggregated_metrics or {}).get(QUEUE_DEPTH)
        if not depths:  # no report yet: keep the current target
            return ctx.target_num_replicas, {}
        waiting = ctx.total_queued_requests or 0.0
        return math.ceil((sum(depths.values()) + waiting) / self.target), {}
