"""Rollout on the serving loops, and replay of what it recorded.

``rollout`` runs a loaded model's program (any card's task) for each request through the real
:class:`~fv_core.runtime.Engine` under ``Profile.ROLLOUT``: the serve path, batched as serving
batches, plus a :class:`~fv_core.loop.BehaviorRecorder` that captures one ``BehaviorRecord`` per
request (per stage for multi-stage programs). Its outputs equal serving the same requests the same
way (batched or interleaved) bit for bit: capture only reads.

Each recorded step holds the inputs its body got (this request's rows only), the prediction, the
generator state (re-noise draws) and the body call it ran in. Conditioning is kept in full, not as
a hash, because replay needs it: the text K/V of every denoise step is one tensor object in the
record (steps whose input is bitwise unchanged share it), so it costs memory and disk once.
``BehaviorRecorder(refs=True)`` keeps content hashes instead (goldens; not replayable).

Replay rebuilds a recorded step's plan on the live weights and runs its body in any profile:
``Profile.SERVE`` (no grad) or ``Profile.TRAIN`` (grad enabled) - the C2 gate compares the two bit
for bit (``check_c2``). A loop makes its steps replayable by implementing

    replay_plan(record: BehaviorRecord, step: StepRecord) -> WorkPlan

(the step's body over ``step.inputs``, with ``batch_size`` rows); records store kinds and labels,
never functions. A step that ran alone is reproduced by ``replay_step``; one that ran in a batched
call (``step.batched_with > 1``) is reproduced bit for bit by replaying its whole call
(``replay_call(model, call_of(records, record, index))``) - alone it may differ by rounding.
``step.replayable`` is False where an interceptor answered the step, drove its blocks or (a KV
policy) chose its context. Replay runs the weights live now: they reproduce the record while
``record.weights_versions`` still names them, and give the updated prediction once training changed
them.

Signatures::

    rollout(model, requests, *, task=None, batching=True, max_batch_rows=8, refs=False,
            budget=None) -> list[Rollout]
    replay_step(model, record, index, profile=Profile.SERVE) -> dict[str, Any]
    replay_call(model, steps, profile=Profile.SERVE) -> list[dict[str, Any]]
    call_of(records, record, index) -> list[tuple[BehaviorRecord, int]]
    check_c2(model, record, index, names=None) -> dict[str, Any]    # the train outputs

Run a train-profile replay outside ``torch.inference_mode`` (it cannot enable grad there).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from fv_core.errors import ConfigError
from fv_core.loop.contracts import LoopResult, Profile, WorkPlan
from fv_core.loop.observers import BehaviorRecord, BehaviorRecorder, StepRecord, same_bits
from fv_core.loop.runner import run_plan
from fv_core.model import LoadedModel
from fv_core.request.request import Request
from fv_core.runtime.admission import Budget
from fv_core.runtime.batching import run_batch
from fv_core.runtime.engine import Engine


@runtime_checkable
class ReplayableLoop(Protocol):
    """A loop whose recorded steps can be rebuilt on its live weights."""

    def replay_plan(self, record: BehaviorRecord, step: StepRecord) -> WorkPlan: ...


@dataclass(slots=True)
class Rollout:
    """One request's rollout."""

    request: Request  # the typed request that ran
    result: LoopResult  # its outputs, as serving gives them
    record: BehaviorRecord | dict[str, BehaviorRecord]  # per stage name for a multi-stage program


def rollout(
    model: LoadedModel,
    requests: Iterable[Request | Mapping[str, Any]],
    *,
    task: str | None = None,
    batching: bool = True,
    max_batch_rows: int = 8,
    refs: bool = False,
    budget: Budget | None = None,
) -> list[Rollout]:
    """Run ``requests`` (typed Requests, or raw params that ``model.prepare(raw, task=task)`` types)
    through the engine under the rollout profile; one Rollout per request, in order.

    :param batching: batch compatible steps of different requests as serving does (else interleave).
    :param refs: record content hashes instead of tensor copies (small; cannot be replayed).
    """
    prepared = [r if isinstance(r, Request) else model.prepare(r, task=task) for r in requests]
    engine = Engine(
        budget,
        profile=Profile.ROLLOUT,
        device=getattr(model.instance, "device", "cpu"),
        observers=(BehaviorRecorder(refs=refs),),
        max_batch_rows=max_batch_rows,
    )
    items = [model.job(r) for r in prepared]
    with torch.no_grad():  # not inference_mode: records feed train-profile replays
        results = engine.run_batched(items) if batching else engine.run_interleaved(items)
    out = []
    for request, result in zip(prepared, results, strict=True):
        assert result is not None and result.behavior is not None, "nothing cancels a rollout's requests"
        out.append(Rollout(request, result, result.behavior))
    return out


def replay_step(
    model: LoadedModel | ReplayableLoop, record: BehaviorRecord, index: int, profile: Profile = Profile.SERVE
) -> dict[str, Any]:
    """Run recorded step ``index``'s body alone on its recorded inputs over the live weights.

    Equals ``record.steps[index].outputs`` bit for bit when the step ran alone
    (``batched_with == 1``), is ``replayable`` and the weights are those of ``weights_versions``."""
    return run_plan(_plan(model, record, index), profile).outputs


def replay_call(
    model: LoadedModel | ReplayableLoop,
    steps: Sequence[tuple[BehaviorRecord, int]],
    profile: Profile = Profile.SERVE,
) -> list[dict[str, Any]]:
    """Run recorded steps as one batched call (rows in the given order); outputs per step."""
    plans = [_plan(model, record, index) for record, index in steps]
    return [r.outputs for r in run_batch(plans, profile)]


def call_of(
    records: Iterable[BehaviorRecord], record: BehaviorRecord, index: int
) -> list[tuple[BehaviorRecord, int]]:
    """The recorded steps that ran in the same body call as ``record.steps[index]``, in row order."""
    step = record.steps[index]
    members = sorted(
        ((r, i) for r in records for i, s in enumerate(r.steps) if s.call == step.call),
        key=lambda m: m[0].steps[m[1]].position,
    )
    if [m[0].steps[m[1]].position for m in members] != list(range(step.batched_with)):
        raise ConfigError(
            f"step {index} of request {record.request_id!r} ran in a call of {step.batched_with} plans; "
            f"the records given hold {len(members)} of them. Fix: pass every record of that rollout."
        )
    return members


def check_c2(
    model: LoadedModel | ReplayableLoop,
    record: BehaviorRecord,
    index: int,
    names: Iterable[str] | None = None,
) -> dict[str, Any]:
    """The C2 gate on one recorded step: its train-profile forward equals its serve-profile forward
    bit for bit on the outputs ``names`` (the quantities a method trains on; default every tensor
    output). Raises AssertionError naming the outputs that differ; returns the train outputs."""
    served = replay_step(model, record, index, Profile.SERVE)
    trained = replay_step(model, record, index, Profile.TRAIN)
    names = [k for k, v in served.items() if isinstance(v, torch.Tensor)] if names is None else list(names)
    bad = [n for n in names if not same_bits(served[n], trained[n].detach())]
    if bad:
        gaps = {n: float((served[n].double() - trained[n].detach().double()).abs().max()) for n in bad}
        raise AssertionError(
            f"C2 gate: step {index} ({record.steps[index].label!r}) of request {record.request_id!r}: "
            f"the train-profile forward differs from the serve-profile forward on {gaps} (max abs)"
        )
    return trained


def _plan(model: LoadedModel | ReplayableLoop, record: BehaviorRecord, index: int) -> WorkPlan:
    if record.refs:
        raise ConfigError(
            f"the record of request {record.request_id!r} holds content hashes, not tensors "
            "(BehaviorRecorder(refs=True)), so its steps cannot be replayed. Fix: roll out with refs=False."
        )
    loop = model.loop(record.loop_id) if isinstance(model, LoadedModel) else model
    if not isinstance(loop, ReplayableLoop):
        raise ConfigError(
            f"loop {type(loop).__name__} (loop id {record.loop_id!r}) cannot rebuild recorded steps: it has "
            "no replay_plan(record, step). Fix: implement it in the family's loop (see "
            "fv_core.training.rollout)."
        )
    return loop.replay_plan(record, record.steps[index])
