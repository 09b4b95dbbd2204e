"""Out of memory inside a step: split the batch, retry its rows alone, fail only a row that fails alone.

A body that raises ``torch.OutOfMemoryError`` or ``MemoryError`` (a test injects either from its
body) inside a batched call is retried row by row (``retry_alone``); rows that run alone give their
results, a row that runs out of memory alone gets an :class:`OutOfMemory` naming the step, its rows,
its predicted peak and the memory budget. The scheduler folds each row's outcome into its own
request, so the others go on unchanged (equal to their solo runs) and the failed one releases its
reservation like any failure.
"""

from __future__ import annotations

import gc
import math

import torch

from fv_core.errors import FvError
from fv_core.loop.contracts import Profile, StepResult, WorkPlan
from fv_core.loop.runner import run_plan

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
