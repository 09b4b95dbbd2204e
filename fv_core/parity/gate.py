"""Parity gates any card's tests can call.

``assert_interleave_parity``: N requests interleaved step by step must be
bit-identical to the same requests run serially (the structural proof that
no per-request state leaks between requests). ``check_batched_parity``:
batched results vs serial within a declared tolerance, reporting the max
difference either way. Both take an Engine or a zero-argument factory, and
the work items or a factory of them (fresh instances per run when state
could otherwise carry over).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fv_core.loop.contracts import LoopResult
from fv_core.parity.compare import leaves, max_abs
from fv_core.runtime.engine import Engine
from fv_core.runtime.scheduler import WorkItem

EngineLike = Engine | Callable[[], Engine]
ItemsLike = Sequence[WorkItem] | Callable[[], Sequence[WorkItem]]


@dataclass(slots=True)
class ParityReport:
    """Outcome of comparing two runs of the same requests."""

    mode: str  # "interleave" or "batched"
    tolerance: float  # max abs allowed (0.0 and exact dtype/shape/bits for the interleave gate)
    max_abs: float = 0.0  # largest difference found over all outputs
    worst: str = ""  # where max_abs was found
    problems: list[str] = field(default_factory=list)  # every output beyond tolerance or mismatched

    @property
    def ok(self) -> bool:
        return not self.problems

    def __str__(self) -> str:
        head = f"{self.mode} parity: max_abs={self.max_abs:.3e} at {self.worst or '-'} (tolerance {self.tolerance:g})"
        return "\n  ".join([head, *self.problems]) if self.problems else head + ": ok"


def assert_interleave_parity(engine: EngineLike, items: ItemsLike) -> ParityReport:
    """Run ``items`` serially and interleaved; assert every output is bit-identical."""
    serial, other = _two_runs(engine, items, "run_interleaved")
    report = compare_results(serial, other, "interleave", tolerance=0.0)
    if not report.ok:
        raise AssertionError(str(report))
    return report


def check_batched_parity(engine: EngineLike, items: ItemsLike, tol: float) -> ParityReport:
    """Run ``items`` serially and batched; assert outputs agree within ``tol``; report the max diff."""
    serial, other = _two_runs(engine, items, "run_batched")
    report = compare_results(serial, other, "batched", tolerance=tol)
    if not report.ok:
        raise AssertionError(str(report))
    return report


def compare_results(
    reference: Sequence[LoopResult | None],
    candidate: Sequence[LoopResult | None],
    mode: str,
    tolerance: float,
) -> ParityReport:
    """Compare per-request outputs; tolerance 0 demands identical dtype, shape and bits."""
    report = ParityReport(mode, tolerance)
    if len(reference) != len(candidate):
        report.problems.append(f"{len(reference)} reference results vs {len(candidate)} candidate results")
        return report
    for i, (ref, cand) in enumerate(zip(reference, candidate, strict=True)):
        if ref is None or cand is None:
            report.problems.append(
                f"request #{i}: a run was cancelled (reference={ref!r:.20}, candidate={cand!r:.20})"
            )
            continue
        _compare_outputs(report, f"request #{i}", ref.outputs, cand.outputs)
    return report


def _compare_outputs(report: ParityReport, who: str, ref: dict[str, Any], cand: dict[str, Any]) -> None:
    ref_leaves, cand_leaves = dict(leaves(ref)), dict(leaves(cand))
    if ref_leaves.keys() != cand_leaves.keys():
        report.problems.append(f"{who}: output names differ: {sorted(ref_leaves)} vs {sorted(cand_leaves)}")
        return
    for path, r in ref_leaves.items():
        c, where = cand_leaves[path], f"{who} output {path!r}"
        if not isinstance(r, torch.Tensor):
            if r != c:
                report.problems.append(f"{where}: {r!r} != {c!r}")
            continue
        if not isinstance(c, torch.Tensor) or r.shape != c.shape or r.dtype != c.dtype:
            report.problems.append(f"{where}: {_describe(r)} vs {_describe(c)}")
            continue
        diff = max_abs(c, r)
        if diff > report.max_abs or not report.worst:
            report.max_abs, report.worst = diff, where
        exact_fail = report.tolerance == 0.0 and not torch.equal(r, c)
        if exact_fail or diff > report.tolerance:
            report.problems.append(f"{where}: max_abs={diff:.3e} > {report.tolerance:g}")


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor{tuple(value.shape)} {value.dtype}"
    return type(value).__name__


def _two_runs(engine: EngineLike, items: ItemsLike, method: str) -> tuple[list, list]:
    make_engine = engine if callable(engine) and not isinstance(engine, Engine) else (lambda: engine)
    make_items = items if callable(items) else (lambda: items)
    first = list(make_items())
    if len(first) < 2:
        raise ValueError(f"parity gate needs at least 2 requests to interleave, got {len(first)}")
    serial = make_engine().run_serial(first)
    other = getattr(make_engine(), method)(list(make_items()))
    return serial, other
