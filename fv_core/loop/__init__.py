"""Driven loops: the contract, the runner, the context, observers and state I/O."""

from fv_core.loop.context import LoopContext, grad_mode
from fv_core.loop.contracts import (
    SEGMENTS,
    BatchKey,
    Done,
    Loop,
    LoopKind,
    LoopResult,
    LoopState,
    Profile,
    StepBody,
    StepResult,
    StreamEvent,
    WorkPlan,
    WorkUnitKind,
)
from fv_core.loop.invariant import attention_rows_invariant, gemm_rows_invariant, per_row, rows_invariant
from fv_core.loop.observers import BehaviorRecord, BehaviorRecorder, Profiler, StepRecord
from fv_core.loop.pins import batch_key, pinned, pinned_module, pinned_state
from fv_core.loop.runner import ActiveLoop, LoopRunner, run_plan
from fv_core.loop.samplers import euler_step, flow_match_sigmas
from fv_core.loop.state_io import load_state, save_state

__all__ = [
    "SEGMENTS",
    "pinned_state",
    "pinned_module",
    "pinned",
    "batch_key",
    "ActiveLoop",
    "BatchKey",
    "BehaviorRecord",
    "BehaviorRecorder",
    "Done",
    "Loop",
    "LoopContext",
    "LoopKind",
    "LoopResult",
    "LoopRunner",
    "LoopState",
    "Profile",
    "Profiler",
    "StepBody",
    "StepRecord",
    "StepResult",
    "StreamEvent",
    "WorkPlan",
    "WorkUnitKind",
    "euler_step",
    "flow_match_sigmas",
    "grad_mode",
    "load_state",
    "save_state",
    "run_plan",
    "per_row",
    "rows_invariant",
    "gemm_rows_invariant",
    "attention_rows_invariant",
]
