"""Parallel plans and groups: one model instance over several processes (torch.distributed).

Plugins use :class:`ParallelPlan` and the step-side helpers (``current``, ``shard``, ``gather``,
``seq_to_heads``, ``heads_to_seq``, ``global_mean``); the core starts and drives the group.
"""

from fv_core.parallel.comm import (
    TRAFFIC,
    Rank,
    current,
    gather,
    global_mean,
    heads_to_seq,
    running_as,
    seq_to_heads,
    sequence_parallel,
    shard,
)
from fv_core.parallel.group import ParallelGroup, Reply, WorkerFailed, WorkerSpec
from fv_core.parallel.plan import ParallelPlan, plan_problems

__all__ = [
    "TRAFFIC",
    "ParallelGroup",
    "ParallelPlan",
    "Rank",
    "Reply",
    "WorkerFailed",
    "WorkerSpec",
    "current",
    "gather",
    "global_mean",
    "heads_to_seq",
    "plan_problems",
    "running_as",
    "seq_to_heads",
    "sequence_parallel",
    "shard",
]
