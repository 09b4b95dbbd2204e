"""``python -m fv_core.parallel.worker``: one worker rank of a parallel group.

Its arguments arrive pickled on stdin (see ``fv_core.parallel.group``); it loads the same model as
rank 0 and runs steps until rank 0 says stop or goes away.
"""

from __future__ import annotations

import os
import pickle
import sys
import traceback
from typing import Any

import torch
import torch.distributed as dist

from fv_core.parallel.group import WorkerSpec, execute, join, moved
from fv_core.parallel.plan import ParallelPlan
from fv_core.parallel.resident import ResidentStore


def worker_main(rank: int, plan: ParallelPlan, spec: WorkerSpec, port: int, threads: int) -> None:
    """A worker rank: load the model, then run steps until rank 0 says stop (or goes away)."""
    torch.set_num_threads(threads)
    me = join(rank, plan, port, spec.device)
    model = spec.load(rank)
    device, resident = model.instance.device, ResidentStore()
    try:
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0)
            step = box[0]
            if step is None:
                break
            try:
                step.inputs = moved(resident.decode(step.inputs, step.evict, device), device)
                reply = execute(model.instance, me, step)
                reply.outputs = moved(reply.outputs, "cpu")
                reply.caches = moved(reply.caches, "cpu")
            except Exception:  # the other ranks may wait in this step's collectives: leave, so they fail now
                traceback.print_exc()
                os._exit(1)
            dist.gather_object(reply, None, dst=0)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    worker_main(*pickle.loads(sys.stdin.buffer.read()))
