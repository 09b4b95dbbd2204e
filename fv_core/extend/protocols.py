"""The extension seam: read-only observers and compute-altering interceptors.

Observers see every step of every request but never change it (Profiler,
BehaviorRecorder, ParityAligner). Interceptors may change a step: a
StepInterceptor can answer a plan without running it (step skip, cached
prediction); a BlockInterceptor drives the span of transformer blocks inside
a step body (skip a span, reuse its cached residual); a KVPolicy decides what a
block-causal loop's chunks attend to in their KV cache and what leaves it.
Interceptor state lives only in ``LoopState.plugin_state[plugin_id][branch]``
(see :func:`plugin_slot`), never in module globals or on shared modules.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from fv_core.loop.contracts import LoopResult, LoopState, StepResult, WorkPlan
from fv_core.loop.seam import BlockFn


@runtime_checkable
class Observer(Protocol):
    """Read-only hooks the runner calls for every request."""

    def on_start(self, state: LoopState, request: Any) -> None: ...

    def on_step(self, state: LoopState, plan: WorkPlan, result: StepResult) -> None: ...

    def on_finish(self, state: LoopState, result: LoopResult) -> None: ...


class BaseObserver:
    """Observer with no-op hooks; subclasses override what they need."""

    def on_start(self, state: LoopState, request: Any) -> None:
        return None

    def on_step(self, state: LoopState, plan: WorkPlan, result: StepResult) -> None:
        return None

    def on_finish(self, state: LoopState, result: LoopResult) -> None:
        return None


@runtime_checkable
class StepInterceptor(Protocol):
    """Wraps the execution of one plan of one request.

    ``before`` runs at the step boundary; returning a StepResult answers the
    plan without running its body (the plan then leaves any batch). ``after``
    sees the real or substituted result and returns the one to fold back.
    A ``kind`` of ``"step_skip"`` marks an interceptor that skips steps (at
    most one per loop; a card must accept the kind). Optional hooks, called
    when present: ``on_start(state, request)`` and ``on_finish(state, result)``.
    """

    plugin_id: str

    def before(self, state: LoopState, plan: WorkPlan) -> StepResult | None: ...

    def after(self, state: LoopState, plan: WorkPlan, result: StepResult) -> StepResult: ...


@runtime_checkable
class BlockInterceptor(Protocol):
    """Drives the transformer blocks of one forward inside a step body (DBCache/FBCache-style skips).

    ``kind`` is ``"block_skip"``. A body whose plan carries ``inputs[BLOCKS_INPUT]``
    calls ``run_blocks`` (through :class:`~fv_core.loop.seam.BlockHook`) once
    per forward and CFG ``branch``. ``caches`` is a working copy of this
    request's ``plugin_state[plugin_id]``: ``caches[branch]`` is the branch's
    state (``plugin_slot(state, plugin_id, branch)``); rebind keys, never
    mutate values in place; the runner commits the copy after the step.
    ``block(i, h)`` computes block ``i`` for real; skipped blocks are simply
    not called. Optional hooks, called when present: ``on_start(state,
    request)`` (read the request's validated options) and ``on_finish(state,
    result)`` (add statistics to ``result.metrics``).
    """

    plugin_id: str
    kind: str

    def run_blocks(
        self,
        caches: dict[str, dict[str, Any]],
        branch: str,
        hidden: torch.Tensor,
        num_blocks: int,
        block: BlockFn,
    ) -> torch.Tensor: ...


@runtime_checkable
class SpanInterceptor(Protocol):
    """A block interceptor that decides per request inside a batch (what lets cached requests batch).

    Per forward of CFG ``branch``: ``begin_span`` (called once, first) names the
    span ``[first, last)`` of blocks it may skip; at block ``first``,
    ``skip_span`` gets this request's rows' residual of blocks ``[0, first)``
    and returns the residual to add instead of running the span, or None to
    run it; after a run span, ``end_span`` gets the span's residual.
    :func:`~fv_core.loop.spans.drive_spans` calls them for each plan of a
    batch on its own rows and its own ``caches`` (rebind, never mutate).
    """

    plugin_id: str
    kind: str

    def begin_span(
        self, caches: dict[str, dict[str, Any]], branch: str, num_blocks: int
    ) -> tuple[int, int]: ...

    def skip_span(
        self, caches: dict[str, dict[str, Any]], branch: str, residual: torch.Tensor
    ) -> torch.Tensor | None: ...

    def end_span(self, caches: dict[str, dict[str, Any]], branch: str, residual: torch.Tensor) -> None: ...


@runtime_checkable
class KVPolicy(Protocol):
    """Decides the cached context of a block-causal loop (``kind`` ``"kv_policy"``; a card must accept it).

    A loop whose chunks attend to a KV cache of earlier blocks (chunks) offers it by chunk plans that
    carry ``inputs[KV_INPUT] = None`` and the cache's layout, one row per request:

    - ``kv_slots`` [rows, S] long: the cached block (slot, oldest first) of each context token, -1 on padding;
    - ``kv_blocks`` [rows, NS] long: each slot's block index in the video, -1 past the last slot;
    - ``kv_frames`` [rows, NS] long: latent frames each slot holds; ``kv_sinks`` [rows, NS] bool: sink blocks;
    - ``kv_room`` [rows] long: on a cache write, frames that must leave the cache first (-1: not a write).

    ``attach(state, plan)`` returns the plan with the policy in ``inputs[KV_INPUT]`` (plus its own
    per-row tensors); the body calls ``selector(inputs)`` once per pass and the selector per layer,
    ``select(layer, q, ctx_k, ctx_v, ctx_valid) -> (ctx_k, ctx_v, ctx_valid)``, keeping the context
    that layer attends to; ``selector.outputs()`` joins the body's outputs. ``after`` (a step
    interceptor's) folds them into ``plugin_state`` and, on a cache write, sets ``outputs["kv_evict"]``:
    the block indices the loop drops (it keeps its own rolling window when the key is absent).
    """

    plugin_id: str
    kind: str

    def attach(self, state: LoopState, plan: WorkPlan) -> WorkPlan: ...

    def selector(self, inputs: dict[str, Any]) -> Any: ...

    def after(self, state: LoopState, plan: WorkPlan, result: StepResult) -> StepResult: ...


def plugin_slot(state: LoopState, plugin_id: str, branch: str = "main") -> dict[str, Any]:
    """The per-request, per-branch state dict owned by one plugin."""
    return state.plugin_state.setdefault(plugin_id, {}).setdefault(branch, {})
