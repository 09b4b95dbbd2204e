"""The extension seam: read-only observers and compute-altering interceptors.

Observers see every step of every request but never change it (Profiler,
BehaviorRecorder, ParityAligner). Interceptors may change a step: a
StepInterceptor can answer a plan without running it (step skip, cached
prediction); a BlockInterceptor wraps one block call inside a step body.
Interceptor state lives only in ``LoopState.plugin_state[plugin_id][branch]``
(see :func:`plugin_slot`), never in module globals or on shared modules.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch

from fv_core.loop.contracts import LoopResult, LoopState, StepResult, WorkPlan


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
    """

    plugin_id: str

    def before(self, state: LoopState, plan: WorkPlan) -> StepResult | None: ...

    def after(self, state: LoopState, plan: WorkPlan, result: StepResult) -> StepResult: ...


@runtime_checkable
class BlockInterceptor(Protocol):
    """Wraps one block call inside a step body (DBCache/FBCache-style skips).

    ``slot`` is the request's ``plugin_slot``; a body that accepts block
    interceptors runs unbatched (``batch_key=None``) and passes the slot in
    its inputs. ``run(hidden)`` computes the block for real.
    """

    plugin_id: str

    def around_block(
        self,
        slot: dict[str, Any],
        index: int,
        hidden: torch.Tensor,
        run: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor: ...


def plugin_slot(state: LoopState, plugin_id: str, branch: str = "main") -> dict[str, Any]:
    """The per-request, per-branch state dict owned by one plugin."""
    return state.plugin_state.setdefault(plugin_id, {}).setdefault(branch, {})
