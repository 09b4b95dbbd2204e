"""Run compatible plans of several requests as one call.

Plans with equal ``batch_key`` run as one ``body`` call on their tensor
inputs concatenated along dim 0 (``batch_size`` rows each; a ``ragged`` input
zero-padded first to the longest along its ragged dim); non-tensor inputs
must be equal, except block hooks (``BLOCKS_INPUT``): each plan's own hook
goes into one :class:`~fv_core.loop.spans.BlockHooks` over its rows, so every
request's interceptor decides on its rows alone. Tensor outputs are split back
by rows, non-tensor outputs are shared. Plans in the packed form (``WorkPlan.packed``) concatenate their
packed inputs along the token dim, the body gets each plan's lengths (``SEGMENTS``), and the outputs
that follow a packed input are split back along it. Measured time is attributed in proportion to each
plan's predicted cost. ``group_calls`` is the fair policy's grouping of a tick's plans into calls.

``Batching`` says which plans may share a call: ``True`` every plan with a batch key, ``False`` none,
``"invariant"`` (``determinism: bitwise``) only plans with an ``invariant_body``, which such a call runs
instead of ``body`` (see WorkPlan): a request's bytes then do not depend on what it was batched with.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal

import torch

from fv_core.loop.context import grad_mode
from fv_core.loop.contracts import SEGMENTS, Profile, StepResult, WorkPlan
from fv_core.loop.runner import run_plan
from fv_core.loop.seam import BLOCKS_INPUT
from fv_core.loop.spans import BlockHooks

Batching = bool | Literal["invariant"]  # which plans may share a call (see the module docstring)


def may_share(plan: WorkPlan, batching: Batching) -> bool:
    """Whether ``plan`` may share a call with plans of its batch key under ``batching``."""
    if not batching or plan.batch_key is None:
        return False
    return batching is True or plan.invariant_body is not None


def concat_inputs(plans: list[WorkPlan]) -> dict[str, Any]:
    first = plans[0]
    out: dict[str, Any] = {}
    if first.packed:
        out[SEGMENTS] = segments(plans)
    for name, value in first.inputs.items():
        if name in first.packed:
            values = [p.inputs[name] for p in plans]
            packed = isinstance(value, torch.Tensor)
            out[name] = torch.cat(values, dim=first.packed[name]) if packed else tuple(values)
        elif name == BLOCKS_INPUT:
            hooks = [p.inputs.get(name) for p in plans]
            members = [(hook, p.batch_size) for hook, p in zip(hooks, plans, strict=True)]
            out[name] = BlockHooks(members) if any(h is not None for h in hooks) else None
        elif isinstance(value, torch.Tensor):
            for p in plans:
                rows = p.inputs[name].shape[0] if p.inputs[name].dim() else 0
                if rows != p.batch_size:
                    raise ValueError(
                        f"plan {p.label!r}: input {name!r} has {rows} rows but batch_size={p.batch_size}; "
                        "tensor inputs of a batchable plan need a leading dim of batch_size"
                    )
            tensors = [p.inputs[name] for p in plans]
            if name in first.ragged:
                tensors = padded(tensors, first.ragged[name])
            out[name] = torch.cat(tensors, dim=0)
        else:
            for p in plans[1:]:
                if p.inputs.get(name) is not value and p.inputs.get(name) != value:
                    raise ValueError(
                        f"plans {first.label!r} and {p.label!r} share batch key {first.batch_key} but differ in "
                        f"non-tensor input {name!r}; put it in the batch key or make it a tensor"
                    )
            out[name] = value
    return out


def segments(plans: list[WorkPlan]) -> dict[str, tuple[int, ...]]:
    """Packed tensor input -> each plan's length along its token dim (plans in the packed form)."""
    out = {}
    for name, dim in plans[0].packed.items():
        if isinstance(plans[0].inputs[name], torch.Tensor):
            for p in plans:
                if p.batch_size != 1 or p.packed != plans[0].packed:
                    raise ValueError(
                        f"plan {p.label!r} joins a packed call with batch_size={p.batch_size} and packed="
                        f"{p.packed}; a packed plan is one row with the same packed inputs as the others. "
                        "Fix: give every plan of this batch key batch_size 1 and the same packed dims"
                    )
            out[name] = tuple(int(p.inputs[name].shape[dim]) for p in plans)
    return out


def padded(tensors: list[torch.Tensor], dim: int) -> list[torch.Tensor]:
    """``tensors`` zero-padded at the end of ``dim`` to the longest (a ragged input, see WorkPlan.ragged)."""
    size = max(t.shape[dim] for t in tensors)
    out = []
    for t in tensors:
        pad = [0, 0] * (t.dim() - dim - 1) + [0, size - t.shape[dim]]
        out.append(torch.nn.functional.pad(t, pad) if size > t.shape[dim] else t)
    return out


def split_outputs(
    outputs: dict[str, Any], sizes: list[int], first: WorkPlan | None = None, seg: dict | None = None
) -> list[dict[str, Any]]:
    """Per plan outputs: tensors split by rows (``sizes``), or, for an output that follows a packed input
    of ``first`` (``packed_outputs``), along that input's dim by its segment lengths ``seg``."""
    total = sum(sizes)
    parts: list[dict[str, Any]] = [{} for _ in sizes]
    follows = first.packed_outputs if first is not None else {}
    for name, value in outputs.items():
        if name in follows and first is not None and seg is not None:
            source = follows[name]
            for part, chunk in zip(parts, value.split(seg[source], dim=first.packed[source]), strict=True):
                part[name] = chunk
        elif isinstance(value, torch.Tensor):
            if value.dim() == 0 or value.shape[0] != total:
                raise ValueError(
                    f"batched output {name!r} has shape {tuple(value.shape)}; expected {total} rows"
                )
            for part, chunk in zip(parts, value.split(sizes, dim=0), strict=True):
                part[name] = chunk
        else:
            for part in parts:
                part[name] = value
    return parts


def run_batch(plans: list[WorkPlan], profile: Profile, invariant: bool = False) -> list[StepResult]:
    """Run plans (equal batch keys) as one call, through their ``invariant_body`` when ``invariant``;
    one plan runs alone."""
    if len(plans) == 1:
        return [run_plan(plans[0], profile)]
    sizes = [p.batch_size for p in plans]
    body = plans[0].invariant_body if invariant else plans[0].body
    assert body is not None, "an invariant batch holds plans with an invariant_body only"
    with grad_mode(profile):
        t0 = time.perf_counter()
        inputs = concat_inputs(plans)
        outputs = body(inputs)
        seconds = time.perf_counter() - t0
    total_cost = sum(p.cost_s for p in plans)
    shares = [p.cost_s / total_cost if total_cost > 0 else 1 / len(plans) for p in plans]
    return [
        StepResult(out, seconds=seconds * share, batched_with=len(plans))
        for out, share in zip(
            split_outputs(outputs, sizes, plans[0], inputs.get(SEGMENTS)), shares, strict=True
        )
    ]


@dataclass(slots=True)
class Batch:
    """Plans of two or more requests run as one call."""

    entries: list[Any]  # owners (the scheduler's entries), one per plan
    plans: list[WorkPlan]  # equal batch keys
    rows: int = 0  # sum of batch_size
    invariant: bool = False  # run through the plans' invariant_body (batching "invariant")


Outcome = StepResult | list[StepResult | BaseException] | BaseException  # per plan for a batch


def group_calls(selected: list[Any], batching: Batching, max_rows: int) -> list[Any]:
    """Entries (each with a pending plan) in order; those with equal batch keys that may share a call
    (``may_share``) join one Batch (up to ``max_rows`` rows), the others stay lone calls."""
    calls: list[Any] = []
    open_at: dict[Any, int] = {}  # batch key -> index in calls of the call still taking rows
    for entry in selected:
        plan = entry.pending
        assert isinstance(plan, WorkPlan), "only entries with a pending WorkPlan are grouped"
        key = plan.batch_key if may_share(plan, batching) else None
        at = open_at.get(key) if key is not None else None
        if at is not None:
            call = calls[at]
            if not isinstance(call, Batch):  # a second plan joins: the lone entry becomes a batch
                call = calls[at] = Batch(
                    [call], [call.pending], call.pending.batch_size, invariant=batching == "invariant"
                )
            if call.rows + plan.batch_size <= max_rows:
                call.entries.append(entry)
                call.plans.append(plan)
                call.rows += plan.batch_size
                continue
        if key is not None:
            open_at[key] = len(calls)
        calls.append(entry)
    return calls


def measured_s(res: Outcome, plans: int) -> float:
    """Measured seconds of one body call over all its plans; 0 unless every plan ran in it (none answered
    by an interceptor, none failed, no out-of-memory split) and its time was not skewed (``timed``)."""
    if isinstance(res, StepResult):
        return res.seconds if res.timed else 0.0
    if not isinstance(res, list) or not all(
        isinstance(r, StepResult) and r.seconds > 0 and r.timed and r.batched_with == plans for r in res
    ):
        return 0.0
    return sum(r.seconds for r in res if isinstance(r, StepResult))
