"""Built-in observers: Profiler (cost calibration) and BehaviorRecorder (rollout capture).

Observers implement ``fv_core.extend.Observer`` structurally (on_start,
on_step, on_finish) and never change a step.
"""

from __future__ import annotations

import itertools
import json
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from fv_core.cache.key import content_hash
from fv_core.loop.contracts import LoopResult, LoopState, StepResult, WorkPlan
from fv_core.loop.seam import BLOCKS_INPUT, KV_INPUT

_SCALARS = (bool, int, float, str)


class Calibrated(Protocol):
    """What the Profiler feeds: ``fv_core.runtime.cost.CostModel`` satisfies it."""

    def observe(self, state: LoopState, plan: WorkPlan, actual_s: float) -> None: ...


class Profiler:
    """Measures real step times and calibrates the cost model online."""

    def __init__(self, cost_model: Calibrated) -> None:
        self.cost_model = cost_model
        self.steps = 0  # steps measured
        self.seconds = 0.0  # total measured seconds

    def on_start(self, state: LoopState, request: Any) -> None:
        return None

    def on_step(self, state: LoopState, plan: WorkPlan, result: StepResult) -> None:
        if result.seconds <= 0:  # answered by an interceptor, nothing ran
            return
        self.steps += 1
        self.seconds += result.seconds
        if result.timed:
            self.cost_model.observe(state, plan, result.seconds)

    def on_finish(self, state: LoopState, result: LoopResult) -> None:
        return None


@dataclass(slots=True)
class StepRecord:
    """One captured step: what its body was given and what it returned, for this request's rows only.

    ``inputs`` and ``outputs`` hold the plan's tensors (detached copies, or content hashes under
    ``refs=True``) and plain values; a tensor bitwise equal to the previous step's input of the same
    name (the step-invariant text K/V) is the very same object, so it is held and saved once.
    """

    step: int  # state.step before the step ran
    kind: str  # WorkUnitKind value
    label: str  # plan label
    inputs: dict[str, Any]  # tensors (detached copies) or their content hashes, plus scalars
    outputs: dict[str, Any]  # same, for the step's outputs
    rng: Any = None  # the request generator's state after the body, before advance draws (re-)noise
    call: str = ""  # body call the step ran in: equal for the plans of one batched call
    position: int = 0  # the plan's place in its call (its rows follow those of earlier positions)
    batched_with: int = 1  # plans that shared the call
    replayable: bool = True  # False: an interceptor answered the step or drove its blocks


@dataclass(slots=True)
class BehaviorRecord:
    """What a rollout produced and how: enough to replay or train on it.

    Loops declare in ``state.values``: ``guidance``, ``weights_versions`` (component -> version at
    init) and ``conditioning`` (names of ``state.tensors`` to keep, e.g. the prompt embeddings);
    ``sigmas`` / ``timesteps`` are read from ``state.values`` or else ``state.tensors``.
    """

    request_id: str  # owning request
    loop_id: str  # loop that ran
    seed: int | None  # request seed (it drew the initial noise; steps' ``rng`` hold later draws)
    schedule: dict[str, Any]  # "sigmas" / "timesteps" the loop declared
    guidance: Any  # state.values["guidance"], if any
    weights_versions: dict[str, str]  # state.values["weights_versions"]: component -> version
    steps: list[StepRecord] = field(default_factory=list)  # per-step inputs and predictions
    values: dict[str, Any] = field(default_factory=dict)  # json-able state.values at start (replay)
    conditioning: dict[str, Any] = field(default_factory=dict)  # declared state.tensors, at finish
    refs: bool = False  # tensors are content hashes (BehaviorRecorder(refs=True)): not replayable


class BehaviorRecorder:
    """Captures a BehaviorRecord per request under the rollout profile.

    ``refs=True`` stores content hashes instead of tensor copies (cheap goldens that cannot be
    replayed). Copies are normal tensors even when the rollout runs under ``torch.inference_mode``,
    so a train-profile replay can use them. Each step records which body call it ran in
    (``call``/``position``/``batched_with``): a batched step's prediction is reproduced bit for bit
    by replaying its whole call (``fv_core.training.replay_call``).
    """

    def __init__(self, refs: bool = False) -> None:
        self.refs = refs
        self._open: dict[str, BehaviorRecord] = {}
        self._done: dict[str, BehaviorRecord] = {}
        self._last: dict[str, dict[str, Any]] = {}  # request key -> "in.<name>" -> last captured value
        self._token = uuid.uuid4().hex[:8]  # call ids of this recorder
        self._calls = itertools.count()
        self._batch: tuple[Any, Any, str, int] | None = None  # open: (output, storage, call, plans seen)
        self._lock = threading.Lock()

    def on_start(self, state: LoopState, request: Any) -> None:
        v, t = state.values, state.tensors
        schedule = {k: v[k] if k in v else t[k] for k in ("sigmas", "timesteps") if k in v or k in t}
        record = BehaviorRecord(
            request_id=state.request_id,
            loop_id=state.loop_id,
            seed=getattr(request, "seed", None),
            schedule={k: self._capture(x) for k, x in schedule.items()},
            guidance=_plain(v.get("guidance")),
            weights_versions=dict(v.get("weights_versions", {})),
            values={k: x for k, x in v.items() if _jsonable(x)},
            refs=self.refs,
        )
        record.values = json.loads(json.dumps(record.values))  # tuples as lists, as a reload has them
        with self._lock:
            self._open[_key(state)] = record
            self._last[_key(state)] = {}

    def on_step(self, state: LoopState, plan: WorkPlan, result: StepResult) -> None:
        key = _key(state)
        with self._lock:
            last = self._last[key]
            call, position = self._call(result)
            # a block interceptor or KV policy shaped the body's work: its inputs alone do not replay it
            hooked = plan.inputs.get(BLOCKS_INPUT) is not None or plan.inputs.get(KV_INPUT) is not None
            step = StepRecord(
                state.step,
                plan.kind.value,
                plan.label,
                self._dict(plan.inputs, "in.", last),
                self._dict(result.outputs, "out.", last),
                rng=None if state.generator is None else self._keep("rng", state.generator.get_state(), last),
                call=call,
                position=position,
                batched_with=result.batched_with,
                # an interceptor's answer took no time and ran alone
                replayable=not hooked and (result.seconds > 0 or result.batched_with > 1),
            )
            self._open[key].steps.append(step)

    def on_finish(self, state: LoopState, result: LoopResult) -> None:
        key = _key(state)
        with self._lock:
            record = self._open.pop(key)
            self._last.pop(key, None)
            names = state.values.get("conditioning", ())
            record.conditioning = {n: self._capture(state.tensors[n]) for n in names if n in state.tensors}
            self._done[key] = record

    def discard(self, state: LoopState) -> None:
        """Forget a request's record (cancelled or failed)."""
        with self._lock:
            self._open.pop(_key(state), None)
            self._last.pop(_key(state), None)

    def take(self, state: LoopState) -> BehaviorRecord | None:
        """Hand over (and forget) the finished record of this request's loop."""
        with self._lock:
            return self._done.pop(_key(state), None)

    def _call(self, result: StepResult) -> tuple[str, int]:
        """The step's call id and position. The plans of a batched call are folded one after the
        other and their tensor outputs are row views of the call's outputs: one storage, which the
        open batch holds on to so that no other tensor can take its address meanwhile."""
        if result.batched_with <= 1:
            self._batch = None
            return f"{self._token}:{next(self._calls)}", 0
        out = next((x for x in result.outputs.values() if isinstance(x, torch.Tensor)), None)
        where = None if out is None else out.untyped_storage().data_ptr()
        if self._batch is not None and self._batch[1] == where and self._batch[3] < result.batched_with:
            _, _, call, seen = self._batch
        else:
            call, seen = f"{self._token}:{next(self._calls)}", 0
        self._batch = (out, where, call, seen + 1) if seen + 1 < result.batched_with else None
        return call, seen

    def _dict(self, values: dict[str, Any], prefix: str, last: dict[str, Any]) -> dict[str, Any]:
        return {
            k: self._keep(prefix + k, v, last) if isinstance(v, torch.Tensor) else v
            for k, v in values.items()
            if isinstance(v, (torch.Tensor, *_SCALARS))
        }

    def _keep(self, name: str, value: torch.Tensor, last: dict[str, Any]) -> Any:
        """A copy of ``value``, or the previous copy of ``name`` when its bits are unchanged."""
        prev = last.get(name)
        if isinstance(prev, torch.Tensor) and same_bits(prev, value):
            return prev
        last[name] = captured = self._capture(value)
        return captured

    def _capture(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        if self.refs:
            return content_hash(value)
        with torch.inference_mode(False):  # a normal tensor, usable by a train-profile replay
            return value.detach().clone()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when ``a`` and ``b`` have equal dtype, shape and device and identical bits (unlike
    ``torch.equal``: -0.0 differs from 0.0, and a NaN equals the same NaN)."""
    if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return False
    return torch.equal(_bits(a), _bits(b))


_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # element size -> integer dtype


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The same memory seen as integers of the element's size (any strides)."""
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.view(_INTS[t.element_size()])


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _plain(value: Any) -> Any:
    """``value`` as a JSON reload gives it back (tuples as lists), when it is json-able."""
    return json.loads(json.dumps(value)) if _jsonable(value) else value


def _key(state: LoopState) -> str:
    return f"{state.request_id}/{state.loop_id}"
