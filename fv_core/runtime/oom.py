"""Out of memory inside a step: split the batch, retry its rows alone, fail only a row that fails alone.

A body that raises ``torch.OutOfMemoryError`` or ``MemoryError`` (a test injects either from its
body) inside a batched call is retried row by row (``retry_alone``); rows that run alone give their
results, a row that runs out of memory alone gets an :class:`OutOfMemory` naming the step, its rows,
its predicted peak and the memory budget. The scheduler folds each row's outcome into its own
request, so the others go on unchanged (equal to their solo runs) and the failed one releases its
reservation like any failure. The rows that ran out of memory together teach the cost model a row limit
for their batch curve (``CostModel.observe_oom``): the scheduler batches fewer rows of that key from then on.
"""

from __future__ import annotations

import gc
import math
from typing import Any

import torch

from fv_core.errors import FvError
from fv_core.loop.contracts import Profile, StepResult, WorkPlan
from fv_core.loop.runner import ActiveLoop, LoopRunner, run_plan
from fv_core.runtime.batching import Batch, run_batch
from fv_core.runtime.cost import CostModel, curve_key

OOM_ERRORS = (torch.OutOfMemoryError, MemoryError)


class OutOfMemory(FvError, MemoryError):
    """A request's step ran out of memory even when run alone; ``code`` is its HTTP error code."""

    code = "out_of_memory"


def free_after_oom() -> None:
    """Drop what the failed call left allocated before retrying (the device cache on GPU)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def out_of_memory(
    request_id: str, plan: WorkPlan, batch_rows: int, budget_bytes: float, exc: BaseException
) -> OutOfMemory:
    """The error of a row that ran out of memory alone, with the numbers."""
    budget = "no memory budget" if math.isinf(budget_bytes) else f"memory budget {budget_bytes:.0f} bytes"
    where = f"alone after its batch of {batch_rows} rows ran out of memory" if batch_rows > 1 else "alone"
    return OutOfMemory(
        f"out_of_memory: request {request_id!r} ran out of memory in {plan.label or plan.kind.value!r} run "
        f"{where} ({plan.batch_size} row(s), predicted peak {plan.peak_bytes} bytes, {budget}): "
        f"{type(exc).__name__}: {exc}. Fix: ask for a smaller shape, fewer frames or steps; or set the "
        "deploy's scheduling.memory_budget_bytes to what the device holds, so requests that cannot fit "
        "are refused at submission"
    )


def retry_alone(
    request_ids: list[str], plans: list[WorkPlan], profile: Profile, budget_bytes: float
) -> list[StepResult | BaseException]:
    """Run each plan alone after its batch ran out of memory; per plan, its result or its error."""
    free_after_oom()
    out: list[StepResult | BaseException] = []
    for rid, plan in zip(request_ids, plans, strict=True):
        try:
            out.append(run_plan(plan, profile))
        except OOM_ERRORS as exc:
            free_after_oom()
            out.append(out_of_memory(rid, plan, len(plans), budget_bytes, exc))
        except Exception as exc:  # any other failure fails that row only, as it would alone
            out.append(exc)
    return out


def run_rows(
    runner: LoopRunner, batch: Batch, profile: Profile, cost: CostModel, budget_bytes: float, decisions: Any
) -> list[StepResult | BaseException]:
    """A batch of several requests' plans as one body call (interceptors may answer plans first); per plan
    its result or error. A call that runs out of memory is split (counted in ``decisions.split``) and its
    rows limit its key. The batch's entries are the scheduler's (``active_loop``, ``request_id``)."""
    actives: list[ActiveLoop] = [e.active_loop for e in batch.entries]
    request_ids, plans = [e.request_id for e in batch.entries], batch.plans
    answers: list[StepResult | BaseException | None] = [
        runner.before(a, p) for a, p in zip(actives, plans, strict=True)
    ]
    todo = [i for i, a in enumerate(answers) if a is None]
    if todo:
        left, rids = [plans[i] for i in todo], [request_ids[i] for i in todo]
        try:
            ran: list[StepResult | BaseException] = list(run_batch(left, profile, batch.invariant))
        except OOM_ERRORS as exc:
            if len(left) == 1:
                ran = [out_of_memory(rids[0], left[0], 1, budget_bytes, exc)]
            else:
                decisions.split += 1
                cost.observe_oom(curve_key(actives[todo[0]].state, left[0]), sum(p.batch_size for p in left))
                ran = retry_alone(rids, left, profile, budget_bytes)
        for i, r in zip(todo, ran, strict=True):
            answers[i] = r
    return answers  # type: ignore[return-value]


def cap_rows(calls: list[Any], cost: CostModel, headroom_bytes: float, max_rows: int) -> list[Any]:
    """Calls (lone entries and batches) with each batch split to its key's row limit (``split_rows``)."""
    parts = [split_rows(c, cost, headroom_bytes, max_rows) if isinstance(c, Batch) else [c] for c in calls]
    return [part for split in parts for part in split]


def split_rows(batch: Batch, cost: CostModel, headroom_bytes: float, max_rows: int) -> list[Any]:
    """A batch as calls within its key's row limit (``CostModel.row_limit``, else ``max_rows``), in order:
    batches of two or more entries, and lone entries."""
    limit = cost.row_limit(curve_key(batch.entries[0].active_loop.state, batch.plans[0]), headroom_bytes)
    limit = limit or max_rows
    if batch.rows <= limit:
        return [batch]
    chunks: list[Batch] = []
    for entry, plan in zip(batch.entries, batch.plans, strict=True):
        if not chunks or chunks[-1].rows + plan.batch_size > limit:
            chunks.append(Batch([], [], 0))
        chunks[-1].entries.append(entry)
        chunks[-1].plans.append(plan)
        chunks[-1].rows += plan.batch_size
    return [c if len(c.entries) > 1 else c.entries[0] for c in chunks]
