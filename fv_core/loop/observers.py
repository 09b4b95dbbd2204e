"""Built-in observers: Profiler (cost calibration) and BehaviorRecorder (rollout capture).

Observers implement ``fv_core.extend.Observer`` structurally (on_start,
on_step, on_finish) and never change a step.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from fv_core.cache.key import content_hash
from fv_core.loop.contracts import LoopResult, LoopState, StepResult, WorkPlan

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
        self.cost_model.observe(state, plan, result.seconds)

    def on_finish(self, state: LoopState, result: LoopResult) -> None:
        return None


@dataclass(slots=True)
class StepRecord:
    """One captured step."""

    step: int  # state.step before the step ran
    kind: str  # WorkUnitKind value
    label: str  # plan label
    inputs: dict[str, Any]  # tensors (detached copies) or their content hashes, plus scalars
    outputs: dict[str, Any]  # same, for the step's outputs


@dataclass(slots=True)
class BehaviorRecord:
    """What a rollout produced and how: enough to replay or train on it."""

    request_id: str  # owning request
    loop_id: str  # loop that ran
    seed: int | None  # request seed
    schedule: dict[str, Any]  # "sigmas" / "timesteps" the loop declared in state.values
    guidance: Any  # state.values["guidance"], if any
    weights_versions: dict[str, str]  # state.values["weights_versions"]: component -> version
    steps: list[StepRecord] = field(default_factory=list)  # per-step inputs and predictions


class BehaviorRecorder:
    """Captures a BehaviorRecord per request under the rollout profile.

    ``refs=True`` stores content hashes instead of tensor copies (cheap
    goldens); loops declare schedule/guidance/weights versions in
    ``state.values`` under the names used by BehaviorRecord.
    """

    def __init__(self, refs: bool = False) -> None:
        self.refs = refs
        self._open: dict[str, BehaviorRecord] = {}
        self._done: dict[str, BehaviorRecord] = {}
        self._lock = threading.Lock()

    def on_start(self, state: LoopState, request: Any) -> None:
        v = state.values
        record = BehaviorRecord(
            request_id=state.request_id,
            loop_id=state.loop_id,
            seed=getattr(request, "seed", None),
            schedule={k: self._capture(v[k]) for k in ("sigmas", "timesteps") if k in v},
            guidance=v.get("guidance"),
            weights_versions=dict(v.get("weights_versions", {})),
        )
        with self._lock:
            self._open[_key(state)] = record

    def on_step(self, state: LoopState, plan: WorkPlan, result: StepResult) -> None:
        step = StepRecord(
            state.step, plan.kind.value, plan.label, self._dict(plan.inputs), self._dict(result.outputs)
        )
        with self._lock:
            self._open[_key(state)].steps.append(step)

    def on_finish(self, state: LoopState, result: LoopResult) -> None:
        with self._lock:
            self._done[_key(state)] = self._open.pop(_key(state))

    def discard(self, state: LoopState) -> None:
        """Forget a request's record (cancelled or failed)."""
        with self._lock:
            self._open.pop(_key(state), None)

    def take(self, state: LoopState) -> BehaviorRecord | None:
        """Hand over (and forget) the finished record of this request's loop."""
        with self._lock:
            return self._done.pop(_key(state), None)

    def _dict(self, values: dict[str, Any]) -> dict[str, Any]:
        return {k: self._capture(v) for k, v in values.items() if isinstance(v, (torch.Tensor, *_SCALARS))}

    def _capture(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        return content_hash(value) if self.refs else value.detach().clone()


def _key(state: LoopState) -> str:
    return f"{state.request_id}/{state.loop_id}"
