"""Programs: several loops of one card run in sequence against one instance.

Every stage's loop is initialised with the same live instance object (e.g.
an AR decode loop, then a diffusion loop, both driving one shared
transformer: no weight copy). A stage's ``bind`` builds its request from
the original request and the results of earlier stages. The scheduler runs
each stage's steps like any other loop's, so programs interleave and batch
with other requests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from fv_core.loop.contracts import Loop, LoopResult
from fv_core.loop.pins import WEIGHTS

Bind = Callable[[Any, dict[str, LoopResult]], Any]


@dataclass(slots=True)
class Stage:
    """One loop of a program."""

    name: str  # unique within the program; keys the stage's result
    loop: Loop  # loop run by this stage
    bind: Bind | None = None  # (request, earlier results) -> this stage's request; None: the request itself


@dataclass(slots=True)
class Program:
    """An ordered composition of loops of one card."""

    name: str  # program id, e.g. "t2i_with_rewrite"
    stages: list[Stage] = field(default_factory=list)  # run in order

    def __post_init__(self) -> None:
        names = [s.name for s in self.stages]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"program {self.name!r}: stage names {names} must be non-empty and unique")

    def stage_request(self, index: int, request: Any, results: dict[str, LoopResult]) -> Any:
        """The request for stage ``index``; its request_id is always the program request's. A later stage
        runs on the versions the first stage pinned (they made what it is handed), whatever weight sync
        landed meanwhile: they go in its carry unless its bind put others there."""
        stage = self.stages[index]
        bound = stage.bind(request, results) if stage.bind is not None else request
        if bound.request_id != request.request_id:
            bound = replace(bound, request_id=request.request_id)
        if getattr(request, "adapters", ()) and not bound.adapters:  # every stage runs the request's adapters
            bound = replace(bound, adapters=request.adapters)
        first = results[self.stages[0].name].metrics if index else {}
        pins = {k: first[k] for k in (WEIGHTS,) if k in first}
        return replace(bound, carry={**pins, **bound.carry}) if pins else bound

    def combine(self, results: dict[str, LoopResult]) -> LoopResult:
        """Program result: the last stage's outputs; per-stage metrics and behaviour by stage name; the
        weights versions the stages ran on."""
        last = results[self.stages[-1].name]
        behaviors = {k: r.behavior for k, r in results.items() if r.behavior is not None}
        versions = {k: v for r in results.values() for k, v in r.metrics.get("weights_versions", {}).items()}
        return LoopResult(
            outputs=dict(last.outputs),
            metrics={
                "stages": {k: r.metrics for k, r in results.items()},
                "steps": sum(r.metrics.get("steps", 0) for r in results.values()),
                **({"weights_versions": versions} if versions else {}),
            },
            behavior=behaviors or None,
        )
