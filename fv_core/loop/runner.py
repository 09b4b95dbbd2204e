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

import torch

from fv_core.adapters.rows import release_adapters, uses_of, with_adapter_rows
from fv_core.errors import ConfigError, NonFiniteOutput
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
from fv_core.loop.pins import ADAPTERS, WEIGHTS
from fv_core.loop.seam import attach_block_hook, attach_kv_policy, commit_block_hook, negotiate
from fv_core.registry import resolve_lazy


@dataclass(slots=True)
class ActiveLoop:
    """One request's loop in flight."""

    loop: Loop  # the (stateless) loop definition
    request: Any  # the Request being served
    instance: Any  # live model instance the loop is bound to
    ctx: LoopContext  # profile, device, observers, interceptors
    state: LoopState  # all per-request state


def _notify(observer: Any, hook: str, *args: Any) -> None:
    """Call an observer's hook when it has one (observers implement what they need)."""
    method = getattr(observer, hook, None)
    if method is not None:
        method(*args)


def check_finite(request_id: str, outputs: dict[str, Any]) -> None:
    """Raise NonFiniteOutput when a floating tensor output holds NaN or infinity."""
    for name, value in outputs.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point() and not torch.isfinite(value).all():
            raise NonFiniteOutput(
                f"request {request_id!r}: output {name!r} holds NaN or infinite values, so nothing is saved. "
                "Fix: check the scheduler config and precision (float32 avoids most overflows), or lower "
                "the guidance scale."
            )


def check_params(request: Any, card: Any) -> None:
    """A request to a card's task carries that task's typed Params (``LoadedModel.prepare`` builds them).
    The scheduler checks it once, at intake (a program's stages may bind other Params), so no loop does."""
    programs = getattr(card, "programs", {})
    if getattr(request, "task", None) not in programs:
        return  # a card-less loop (tests, benches) takes what it is given
    expected = resolve_lazy(card.params_of(request.task))
    if not isinstance(request.params, expected):
        raise ConfigError(
            f"request {request.request_id!r} to task {request.task!r} of {card.model_id!r} carries "
            f"{type(request.params).__name__} params, not {expected.__name__}. "
            "Fix: build requests with LoadedModel.prepare (fv_core.load(...).prepare(...))."
        )


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

        The request's own interceptors (those its model's deployment enabled) join the engine's;
        those of kind ``observer`` join the observers, and see every step like them."""
        extra = tuple(getattr(request, "interceptors", ()))
        if extra:
            watch = tuple(i for i in extra if getattr(i, "kind", None) == "observer")
            act = tuple(i for i in extra if i not in watch)
            ctx = replace(ctx, interceptors=(*ctx.interceptors, *act), observers=(*ctx.observers, *watch))
        card = getattr(instance, "card", None)
        if ctx.interceptors and card is not None:
            negotiate(card, ctx.interceptors)
        state = loop.init(request, instance, ctx) if state is None else state
        for icp in ctx.interceptors:
            if hasattr(icp, "on_start"):
                icp.on_start(state, request)
        for obs in ctx.observers:
            _notify(obs, "on_start", state, request)
        return ActiveLoop(loop, request, instance, ctx, state)

    def plan(self, active: ActiveLoop) -> WorkPlan | Done:
        """The loop's description of its next step (kernel-free), with a block hook or KV policy attached."""
        plan = active.loop.next(active.state)
        if isinstance(plan, WorkPlan):
            plan = with_adapter_rows(active.instance, uses_of(active.state.values), plan)
        if active.ctx.interceptors and isinstance(plan, WorkPlan):
            plan = attach_block_hook(active.state, plan, active.ctx.interceptors)
            plan = attach_kv_policy(active.state, plan, active.ctx.interceptors)
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
            _notify(obs, "on_step", active.state, plan, result)
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
        """Finalize (non-finite outputs are an error), notify observers, attach the behaviour record."""
        active.state.done = True
        result = active.loop.finalize(active.state)
        check_finite(active.state.request_id, result.outputs)
        for icp in active.ctx.interceptors:
            if hasattr(icp, "on_finish"):
                icp.on_finish(active.state, result)
        for obs in active.ctx.observers:
            _notify(obs, "on_finish", active.state, result)
        if active.ctx.recorder is not None:
            result.behavior = active.ctx.recorder.take(active.state)
        result.metrics.setdefault("steps", active.state.step)
        for pins in (WEIGHTS, ADAPTERS):  # what it ran on: provenance, and a program's later stages
            if pins in active.state.values:
                result.metrics.setdefault(pins, dict(active.state.values[pins]))
        result.metrics.setdefault("stop_reason", reason)
        release_adapters(active.instance, active.state.request_id)
        return result

    def abandon(self, active: ActiveLoop) -> None:
        """Stop a loop without finalizing it (cancel, error): its state is released, and a loop that holds
        resources outside its state (pages of a KV pool) frees them in its ``release(state)``."""
        active.state.done = True
        release_adapters(active.instance, active.state.request_id)
        release = getattr(active.loop, "release", None)
        if release is not None:
            release(active.state)
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
