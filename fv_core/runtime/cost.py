"""Predicted seconds: the one currency of the scheduler, calibrated online.

A plan's raw prediction is its own ``cost_s`` or, when that is 0, the
LoopSpec step cost ``base_s + per_token_s * tokens`` of its loop. The
Profiler feeds measured times back; the model keeps an EMA of actual/raw
per calibration key (loop id, unit kind, instance: shape is already in the
raw prediction) and predicts ``raw * ratio``.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from dataclasses import dataclass

import torch

from fv_core.card.spec import StepCostModel
from fv_core.loop.contracts import LoopState, WorkPlan


@dataclass(slots=True)
class Calibration:
    """Online correction for one calibration key."""

    ratio: float = 1.0  # EMA of actual / raw predicted seconds
    samples: int = 0  # measurements folded in


def calibration_key(state: LoopState, plan: WorkPlan) -> Hashable:
    """Loop, unit kind and instance: the raw model already scales with shape, the ratio corrects its scale."""
    instance = plan.batch_key.instance if plan.batch_key is not None else ""
    return (state.loop_id, plan.kind.value, instance)


def plan_tokens(plan: WorkPlan) -> int:
    """Token count of a plan: rows of its largest tensor input, all dims but the last."""
    sizes = [
        t.numel() // (t.shape[-1] if t.dim() > 1 else 1)
        for t in plan.inputs.values()
        if isinstance(t, torch.Tensor)
    ]
    return max(sizes, default=plan.batch_size)


class CostModel:
    """Step cost predictions per loop, corrected by measured step times."""

    def __init__(self, alpha: float = 0.3, default_step_s: float = 1e-3) -> None:
        self.alpha = alpha  # EMA weight of the newest measurement
        self.default_step_s = default_step_s  # raw cost of a plan with no cost_s and no registered model
        self._specs: dict[str, StepCostModel] = {}
        self._calib: dict[Hashable, Calibration] = {}
        self._lock = threading.Lock()

    def register(self, loop_id: str, step_cost: StepCostModel) -> None:
        """Use a LoopSpec's step cost model for plans of ``loop_id`` that carry no cost_s."""
        self._specs[loop_id] = step_cost

    def fill(self, state: LoopState, plan: WorkPlan) -> WorkPlan:
        """Fill a plan's raw ``cost_s`` and ``peak_bytes`` from the registered model when unset."""
        spec = self._specs.get(state.loop_id)
        if plan.cost_s <= 0:
            plan.cost_s = spec.base_s + spec.per_token_s * plan_tokens(plan) if spec else self.default_step_s
        if plan.peak_bytes <= 0 and spec is not None:
            plan.peak_bytes = spec.peak_bytes_per_token * plan_tokens(plan)
        return plan

    def ratio(self, key: Hashable) -> float:
        calib = self._calib.get(key)
        return calib.ratio if calib else 1.0

    def predict(self, state: LoopState, plan: WorkPlan) -> float:
        """Calibrated predicted seconds of a filled plan."""
        return plan.cost_s * self.ratio(calibration_key(state, plan))

    def observe(self, state: LoopState, plan: WorkPlan, actual_s: float) -> None:
        """Fold one measured step time into the EMA of its key."""
        if plan.cost_s <= 0:
            return
        sample, key = actual_s / plan.cost_s, calibration_key(state, plan)
        with self._lock:
            calib = self._calib.get(key)
            if calib is None:
                calib = self._calib[key] = Calibration()
            calib.ratio = (
                sample if calib.samples == 0 else (1 - self.alpha) * calib.ratio + self.alpha * sample
            )
            calib.samples += 1

    def calibrations(self) -> dict[Hashable, Calibration]:
        return dict(self._calib)
