"""The runtime: engine, scheduler, admission, cost model, batching, async engine."""

from fv_core.runtime.admission import AdmissionController, Budget, Estimate, Reservation, resident_bytes
from fv_core.runtime.async_engine import AsyncEngine
from fv_core.runtime.batching import concat_inputs, run_batch, split_outputs
from fv_core.runtime.cost import BatchCurve, Calibration, CostModel, calibration_key
from fv_core.runtime.engine import Engine
from fv_core.runtime.oom import OutOfMemory
from fv_core.runtime.policy import Decisions, SchedulingPolicy
from fv_core.runtime.scheduler import Scheduler, SchedulerConfig, WorkItem

__all__ = [
    "AdmissionController",
    "AsyncEngine",
    "BatchCurve",
    "Budget",
    "Calibration",
    "CostModel",
    "Decisions",
    "Engine",
    "Estimate",
    "OutOfMemory",
    "Reservation",
    "Scheduler",
    "SchedulerConfig",
    "SchedulingPolicy",
    "WorkItem",
    "calibration_key",
    "concat_inputs",
    "resident_bytes",
    "run_batch",
    "split_outputs",
]
