"""Predicted seconds: the one currency of the scheduler, calibrated online.

A plan's raw prediction is its own ``cost_s`` or, when that is 0, the
LoopSpec step cost ``base_s + per_token_s * tokens`` of its loop. The
Profiler feeds measured times back; the model keeps an EMA of actual/raw
per calibration key (loop id, unit kind, instance: shape is already in the
raw prediction) and predicts ``raw * ratio``.

The batch curve is learned beside it: per curve key (loop id, unit kind, batch
key: instance, shape bucket, precision) the measured seconds of one body call
by its rows (the median of its latest calls: a CPU's jitter and the odd slow
call move it less than an average), so the scheduler can ask what a call of ``rows`` rows costs before
deciding to batch (``batch_cost``). Each call's prediction and measurement are
kept too (``record``), so a miscalibrated model shows (``accuracy``).

Memory is in the same curve: the peak activation bytes per row measured for a curve key
(``observe_peak``, see memory.py) replace a plan's declared ``peak_bytes`` (``fill``), so admission
reserves measured peaks; a batched call that ran out of memory at N rows caps that key's calls below N
rows until a call of N or more rows succeeds (``observe_oom``, ``row_limit``). A program's later stages
are priced by the measured seconds of the same stage of earlier requests (``observe_stage``,
``stage_s``), in the scheduler's clock currency, so remaining work counts every stage left.
"""

from __future__ import annotations

import math
import statistics
import threading
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from fv_core.card.spec import StepCostModel
from fv_core.loop.contracts import LoopState, WorkPlan


@dataclass(slots=True)
class Calibration:
    """Online correction for one calibration key."""

    ratio: float = 1.0  # EMA of actual / raw predicted seconds
    samples: int = 0  # measurements folded in


@dataclass(slots=True)
class BatchCurve:
    """Measured seconds of one body call by its rows, for one loop and shape bucket."""

    seconds: dict[int, float] = field(default_factory=dict)  # rows -> median of its latest measured calls
    recent: dict[int, deque[float]] = field(default_factory=dict)  # rows -> its latest measured call seconds
    alone_since_batch: int = 0  # calls run alone since the last batched measurement (re-probe clock)
    peak_row_bytes: float = 0.0  # most peak activation bytes per row measured (0: not measured)
    peak_rows: set[int] = field(default_factory=set)  # row counts whose peak was measured
    oom_rows: int | None = None  # a call of this many rows ran out of memory: calls stay below it

    def predict(self, rows: int) -> float | None:
        """Seconds of a call of ``rows`` rows: measured, else the least-squares line through the
        measured rows (one measured size: proportional to rows, no sharing assumed); None unmeasured."""
        if rows in self.seconds:
            return self.seconds[rows]
        if not self.seconds:
            return None
        xs, ys = list(self.seconds), list(self.seconds.values())
        if len(xs) == 1:
            return ys[0] * rows / xs[0]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        slope = max(
            0.0,
            sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs),
        )
        return max(my + slope * (rows - mx), min(ys))

    def batched(self) -> bool:
        """Whether a call of two or more rows was measured."""
        return any(r > 1 for r in self.seconds)


def curve_key(state: LoopState, plan: WorkPlan) -> Hashable | None:
    """Loop, unit kind and batch key (instance, shape bucket, precision); None for a never-batched plan."""
    return None if plan.batch_key is None else (state.loop_id, plan.kind.value, plan.batch_key)


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

    def __init__(self, alpha: float = 0.3, default_step_s: float = 1e-3, window: int = 9) -> None:
        self.alpha = alpha  # EMA weight of the newest measurement (calibration ratios, program stages)
        self.window = window  # batch curves: a call's seconds are the median of this many latest calls
        self.default_step_s = default_step_s  # raw cost of a plan with no cost_s and no registered model
        self._specs: dict[str, StepCostModel] = {}
        self._calib: dict[Hashable, Calibration] = {}
        self._curves: dict[Hashable, BatchCurve] = {}
        self._lock = threading.Lock()
        self.predicted_s = 0.0  # predicted seconds of every recorded call
        self.measured_s = 0.0  # measured seconds of the same calls
        self.errors: deque[float] = deque(maxlen=256)  # |measured / predicted - 1| of the latest calls
        self.warm_errors: deque[float] = deque(maxlen=256)  # the same, of calls priced after warm-up
        self._stages: dict[Hashable, float] = {}  # (program, stage, instance) -> EMA of its seconds
        self._steps: dict[Hashable, float] = {}  # (open-ended loop, instance) -> EMA of its steps

    def register(self, loop_id: str, step_cost: StepCostModel) -> None:
        """Use a LoopSpec's step cost model for plans of ``loop_id`` that carry no cost_s."""
        self._specs[loop_id] = step_cost

    def fill(self, state: LoopState, plan: WorkPlan) -> WorkPlan:
        """Fill a plan's raw ``cost_s`` from the registered model when unset; its ``peak_bytes`` from the
        measured peak per row of its curve, else (when unset) from the registered model."""
        spec = self._specs.get(state.loop_id)
        if plan.cost_s <= 0:
            plan.cost_s = spec.base_s + spec.per_token_s * plan_tokens(plan) if spec else self.default_step_s
        key = curve_key(state, plan)
        measured = self._curves[key].peak_row_bytes if key in self._curves else 0.0
        if measured > 0:
            plan.peak_bytes = math.ceil(measured * plan.batch_size)
        elif plan.peak_bytes <= 0 and spec is not None:
            plan.peak_bytes = spec.peak_bytes_per_token * plan_tokens(plan)
        return plan

    def ratio(self, key: Hashable) -> float:
        calib = self._calib.get(key)
        return calib.ratio if calib else 1.0

    def predict(self, state: LoopState, plan: WorkPlan) -> float:
        """Calibrated predicted seconds of a filled plan."""
        return plan.cost_s * self.ratio(calibration_key(state, plan))

    def solo_s(self, state: LoopState, plan: WorkPlan) -> float:
        """Predicted seconds of a filled plan run alone: its batch curve's where measured (the seconds the
        scheduler's clock counts), else the calibrated prediction."""
        measured = self.batch_cost(curve_key(state, plan), plan.batch_size)
        return self.predict(state, plan) if measured is None else measured

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

    def curves(self) -> dict[Hashable, BatchCurve]:
        return dict(self._curves)

    def curve(self, key: Hashable) -> BatchCurve:
        """The batch curve of a curve key (empty until a call is measured)."""
        with self._lock:
            return self._curves.setdefault(key, BatchCurve())

    def batch_cost(self, key: Hashable | None, rows: int) -> float | None:
        """Predicted seconds of one call of ``rows`` rows of ``key``; None when nothing was measured."""
        return None if key is None else self.curve(key).predict(rows)

    def observe_call(self, key: Hashable | None, rows: int, actual_s: float) -> None:
        """Fold one measured body call of ``rows`` rows into its batch curve."""
        if key is None or rows < 1 or actual_s <= 0:
            return
        curve = self.curve(key)
        with self._lock:
            recent = curve.recent.setdefault(rows, deque(maxlen=self.window))
            recent.append(actual_s)
            curve.seconds[rows] = statistics.median(recent)
            curve.alone_since_batch = 0 if rows > 1 else curve.alone_since_batch + 1
            if curve.oom_rows is not None and rows >= curve.oom_rows:
                curve.oom_rows = rows + 1  # evidence: this many rows fit now

    def wants_peak(self, key: Hashable | None, rows: int) -> bool:
        """Whether a call of ``rows`` rows of ``key`` should have its peak bytes measured: the key's first
        call (activations grow with rows; measuring once keeps the tracking's cost to one call per key)."""
        return key is not None and not self.curve(key).peak_rows

    def observe_peak(self, key: Hashable | None, rows: int, peak_bytes: int) -> None:
        """Fold one measured call peak into its curve's peak bytes per row (the largest seen)."""
        if key is None or rows < 1:
            return
        curve = self.curve(key)
        with self._lock:
            curve.peak_rows.add(rows)
            curve.peak_row_bytes = max(curve.peak_row_bytes, peak_bytes / rows)

    def observe_oom(self, key: Hashable | None, rows: int) -> None:
        """A call of ``rows`` rows ran out of memory: calls of ``key`` stay below ``rows`` rows."""
        if key is not None and rows > 1:
            curve = self.curve(key)
            with self._lock:
                curve.oom_rows = min(rows, curve.oom_rows or rows)

    def row_limit(self, key: Hashable | None, headroom_bytes: float = math.inf) -> int | None:
        """Most rows a call of ``key`` may have: below the rows that ran out of memory, and within
        ``headroom_bytes`` at the measured peak per row (at least 1); None when nothing limits it."""
        curve = self._curves.get(key) if key is not None else None
        if curve is None:
            return None
        limits = [curve.oom_rows - 1] if curve.oom_rows else []
        if curve.peak_row_bytes > 0 and math.isfinite(headroom_bytes):
            limits.append(int(headroom_bytes // curve.peak_row_bytes))
        return max(1, min(limits)) if limits else None

    def observe_stage(self, program: str, stage: str, instance: Any, seconds: float) -> None:
        """Fold the seconds (scheduler clock) one program stage on ``instance`` took into its EMA."""
        key = (program, stage, id(instance))
        with self._lock:
            old = self._stages.get(key)
            self._stages[key] = seconds if old is None else (1 - self.alpha) * old + self.alpha * seconds

    def stages_s(self, program: str, stages: list[str], instance: Any) -> float:
        """Predicted seconds of program stages not yet started (each 0 until one ran on ``instance``)."""
        return sum(self._stages.get((program, stage, id(instance)), 0.0) for stage in stages)

    def observe_steps(self, loop_id: str, instance: Any, steps: int) -> None:
        """An open-ended loop (no ``total_steps``: AR decoding) of ``loop_id`` finished after ``steps``."""
        key = (loop_id, id(instance))
        with self._lock:
            old = self._steps.get(key)
            self._steps[key] = steps if old is None else (1 - self.alpha) * old + self.alpha * steps

    def open_steps(self, loop_id: str, instance: Any, cap: int) -> float:
        """Steps an open-ended loop is priced at: what such loops took before (EMA), else ``cap``."""
        return min(cap, self._steps.get((loop_id, id(instance)), cap))

    def price_call(
        self, states: list[LoopState], plans: list[WorkPlan]
    ) -> tuple[Hashable | None, int, float]:
        """A body call's batch curve key, rows and predicted seconds: its batch curve's where measured,
        else the calibrated seconds of its plans run apart."""
        key, rows = curve_key(states[0], plans[0]), sum(p.batch_size for p in plans)
        curve = self.batch_cost(key, rows)
        apart = sum(self.predict(s, p) for s, p in zip(states, plans, strict=True))
        return key, rows, apart if curve is None else curve

    def warm(self, key: Hashable | None, rows: int, calls: int = 3) -> bool:
        """Whether calls of ``rows`` rows of ``key`` are past warm-up: priced from ``calls`` measured ones."""
        curve = self._curves.get(key) if key is not None else None
        return curve is not None and len(curve.recent.get(rows, ())) >= calls

    def record(self, predicted_s: float, measured_s: float, warm: bool = False) -> None:
        """Keep one call's predicted and measured seconds (the accuracy the fleet sees); ``warm``: it was
        priced after warm-up (see ``warm``)."""
        if predicted_s <= 0 or measured_s <= 0:
            return
        with self._lock:
            self.predicted_s += predicted_s
            self.measured_s += measured_s
            self.errors.append(abs(measured_s / predicted_s - 1))
            if warm:
                self.warm_errors.append(abs(measured_s / predicted_s - 1))

    def accuracy(self) -> dict[str, float]:
        """Summed predicted and measured call seconds, and the median relative error of the latest calls
        (all, and those priced after warm-up)."""
        with self._lock:
            errors, warm = list(self.errors), list(self.warm_errors)
        return {
            "predicted_s": self.predicted_s,
            "measured_s": self.measured_s,
            "median_rel_error": statistics.median(errors) if errors else 0.0,
            "median_rel_error_warm": statistics.median(warm) if warm else 0.0,
        }
