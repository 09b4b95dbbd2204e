"""LoopRunner: the only place iteration lives.

A loop only describes steps; the runner drives ``init -> (next -> advance)*
-> finalize`` and applies the extension seam around every step: step
interceptors (``before``/``after``), block interceptors (a BlockHook in the
plan's inputs, committed after the step) and read-only observers. The scheduler
calls the pieces (``start``, ``plan``, ``before``, ``complete``, ``finish``)
so that it can interleave and batch steps of many requests; ``run`` drives
one request alone with the same pieces.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from fv_core.extend.seam import attach_block_hook, commit_block_hook, negotiate
from fv_core.loop.context import LoopContext, grad_mode
from fv_core.loop.contracts import (
    Done,
    Loop,
    LoopResult,
    LoopState,
    Profile,
    StepResult,
    StreamEvent,
    WorkPlan,
)


@dataclass(slots=True)
class ActiveLoop:
    """One request's loop in flight."""

    loop: Loop  # the (stateless) loop definition
    request: Any  # the Request being served
    instance: Any  # live model instance the loop is bound to
    ctx: LoopContext  # profile, device, observers, interceptors
    state: LoopState  # all per-request state


def run_plan(plan: WorkPlan, profile: Profile) -> StepResult:
    """Run one plan's body alone, timed, in the profile's grad mode."""
    with grad_mode(profile):
        t0 = time.perf_counter()
        outputs = plan.body(plan.inputs)
        return StepResult(outputs, seconds=time.perf_counter() - t0)


class LoopRunner:
    """Drives loops step by step; holds no per-request state itself."""

    def start(
        self, loop: Loop, request: Any, instance: Any, ctx: LoopContext, state: LoopState | None = None
    ) -> ActiveLoop:
        """Negotiate interceptors with the card, initialise (or resume from ``state``), notify hooks.

        The request's own interceptors (those its model's deployment enabled) join the engine's."""
        extra = tuple(getattr(request, "interceptors", ()))
        if extra:
            ctx = replace(ctx, interceptors=(*ctx.interceptors, *extra))
        card = getattr(instance, "card", None)
        if ctx.interceptors and card is not None:
            negotiate(card, ctx.interceptors)
        state = loop.init(request, instance, ctx) if state is None else state
        for icp in ctx.interceptors:
            if hasattr(icp, "on_start"):
                icp.on_start(state, request)
        for obs in ctx.observers:
            obs.on_start(state, request)
        return ActiveLoop(loop, request, instance, ctx, state)

    def plan(self, active: ActiveLoop) -> WorkPlan | Done:
        """The loop's description of its next step (kernel-free), with a block hook attached if any."""
        plan = active.loop.next(active.state)
        if active.ctx.interceptors and isinstance(plan, WorkPlan):
            plan = attach_block_hook(active.state, plan, active.ctx.interceptors)
        return plan

    def before(self, active: ActiveLoop, plan: WorkPlan) -> StepResult | None:
        """First interceptor answer that replaces running the plan, if any."""
        for icp in active.ctx.interceptors:
            result = icp.before(active.state, plan) if hasattr(icp, "before") else None
            if result is not None:
                return result
        return None

    def complete(self, active: ActiveLoop, plan: WorkPlan, result: StepResult) -> list[StreamEvent]:
        """Fold a result back: block hook, interceptors ``after``, observers, ``advance``; returns events."""
        commit_block_hook(active.state, plan)
        for icp in reversed(active.ctx.interceptors):
            if hasattr(icp, "after"):
                result = icp.after(active.state, plan, result)
        for obs in active.ctx.observers:
            obs.on_step(active.state, plan, result)
        active.state = active.loop.advance(active.state, result)
        st = active.state
        events = [
            StreamEvent(k, st.request_id, st.step, st.total_steps, plan.label)
            for k in plan.emits
            if k == "progress"
        ]
        if "partial" in plan.emits:
            events.append(StreamEvent("partial", st.request_id, st.step, st.total_steps, result.outputs))
        return events

    def finish(self, active: ActiveLoop, reason: str = "finished") -> LoopResult:
        """Finalize, notify observers, attach the behaviour record under rollout."""
        active.state.done = True
        result = active.loop.finalize(active.state)
        for icp in active.ctx.interceptors:
            if hasattr(icp, "on_finish"):
                icp.on_finish(active.state, result)
        for obs in active.ctx.observers:
            obs.on_finish(active.state, result)
        if active.ctx.recorder is not None:
            result.behavior = active.ctx.recorder.take(active.state)
        result.metrics.setdefault("steps", active.state.step)
        result.metrics.setdefault("stop_reason", reason)
        return result

    def abandon(self, active: ActiveLoop) -> None:
        """Stop a loop without finalizing it (cancel, error): its state is released."""
        active.state.done = True
        if active.ctx.recorder is not None:
            active.ctx.recorder.discard(active.state)

    def run(
        self,
        loop: Loop,
        request: Any,
        instance: Any,
        ctx: LoopContext,
        state: LoopState | None = None,
        on_event: Callable[[StreamEvent], None] | None = None,
    ) -> LoopResult:
        """Drive one request to completion, alone."""
        active = self.start(loop, request, instance, ctx, state)
        while not isinstance(plan := self.plan(active), Done):
            result = self.before(active, plan) or run_plan(plan, ctx.profile)
            for event in self.complete(active, plan, result):
                if on_event is not None:
                    on_event(event)
        return self.finish(active, plan.reason)
