"""ParityAligner: record named taps per step from a reference run, then find the first divergence.

Taps are the tensors a step consumes (``in.<name>``) and produces
(``out.<name>``). Run the reference with the aligner attached, call
``replay()``, run the candidate with the same seeds, then read
``first_divergence()`` / ``report()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fv_core.loop.contracts import LoopResult, LoopState, StepResult, WorkPlan
from fv_core.parity.compare import max_abs


@dataclass(slots=True, frozen=True)
class Divergence:
    """A tap beyond its tolerance."""

    request_id: str  # which request
    loop_id: str  # which loop
    step: int  # state.step when the step ran
    tap: str  # "in.x" / "out.v"
    max_abs: float  # difference to the reference (inf if the tap is missing or reshaped)
    tolerance: float  # allowed max abs for this tap

    def __str__(self) -> str:
        return (
            f"request {self.request_id!r} loop {self.loop_id!r} step {self.step} tap {self.tap!r}: "
            f"max_abs={self.max_abs:.3e} > {self.tolerance:g}"
        )


class ParityAligner:
    """Observer that records taps, then compares a replay against them."""

    def __init__(
        self,
        taps: Sequence[str] | None = None,
        tolerances: dict[str, float] | None = None,
        default_tol: float = 0.0,
    ) -> None:
        self.taps = set(taps) if taps is not None else None  # None: every tensor tap
        self.tolerances = dict(tolerances or {})  # per tap max abs
        self.default_tol = default_tol  # for taps without their own tolerance
        self.recording = True  # False after replay()
        self.reference: dict[tuple[str, str, int, str], torch.Tensor] = {}
        self.divergences: list[Divergence] = []
        self.compared = 0  # taps compared during replay

    def replay(self) -> None:
        """Switch from recording the reference to comparing against it."""
        self.recording = False
        self.divergences.clear()
        self.compared = 0

    def on_start(self, state: LoopState, request: Any) -> None:
        return None

    def on_step(self, state: LoopState, plan: WorkPlan, result: StepResult) -> None:
        for tap, value in self._taps(plan, result):
            key = (state.request_id, state.loop_id, state.step, tap)
            if self.recording:
                self.reference[key] = value.detach().clone()
                continue
            self.compared += 1
            tol = self.tolerances.get(tap, self.default_tol)
            ref = self.reference.get(key)
            diff = max_abs(value, ref) if ref is not None and ref.shape == value.shape else float("inf")
            if diff > tol:
                self.divergences.append(
                    Divergence(state.request_id, state.loop_id, state.step, tap, diff, tol)
                )

    def on_finish(self, state: LoopState, result: LoopResult) -> None:
        return None

    def first_divergence(self) -> Divergence | None:
        """The earliest step (then tap order) beyond tolerance, or None."""
        return min(self.divergences, key=lambda d: d.step, default=None)

    def report(self) -> str:
        first = self.first_divergence()
        if first is None:
            return f"aligned: {self.compared} taps within tolerance"
        return f"{len(self.divergences)} of {self.compared} taps diverged; first: {first}"

    def _taps(self, plan: WorkPlan, result: StepResult) -> list[tuple[str, torch.Tensor]]:
        found = [(f"in.{k}", v) for k, v in plan.inputs.items() if isinstance(v, torch.Tensor)]
        found += [(f"out.{k}", v) for k, v in result.outputs.items() if isinstance(v, torch.Tensor)]
        return [(t, v) for t, v in found if self.taps is None or t in self.taps]
