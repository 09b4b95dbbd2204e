"""The training plane: the trainer, its config, method specs, family adapters, rewards, datasets.

Training methods (plugins registered through ``fv_register_methods``) run the same ``WorkPlan``
bodies the serve loops run (through a family's ``TrainAdapter``) under ``Profile.TRAIN``: one
implementation of the model and the sampler for serving, rollout and training. The runtime never
imports this.
"""

from __future__ import annotations

from typing import Any

from fv_core.loop.contracts import Profile, WorkPlan
from fv_core.loop.observers import BehaviorRecord, StepRecord, same_bits
from fv_core.loop.runner import run_plan
from fv_core.training.adapter import TrainAdapter, adapter_class, train_adapter
from fv_core.training.config import (
    DataConfig,
    OptimConfig,
    StrictModel,
    TrainConfig,
    check_train_device,
    load_config,
    read_prompts,
    validate,
    validate_options,
)
from fv_core.training.datasets import Dataset, load_dataset
from fv_core.training.dmd import DistributionMatching, DMDOptions
from fv_core.training.method import Consistency, MethodSpec, Role, RoleSpec, TrainMethod
from fv_core.training.records import load_records, records_equal, save_records
from fv_core.training.reward import Reward, load_reward
from fv_core.training.rollout import (
    ReplayableLoop,
    Rollout,
    call_of,
    check_c2,
    replay_call,
    replay_step,
    rollout,
)
from fv_core.training.stop import StopRequest, TrainingStopped
from fv_core.training.sync import SyncResult, WeightSyncPlan, push_weights, sync_weights
from fv_core.training.trainer import (
    load_optimizer,
    make_optimizer,
    plot_loss,
    save_optimizer,
    set_lr,
    train,
)


def run_body(plan: WorkPlan, train: bool) -> dict[str, Any]:
    """The plan's outputs under the train profile (grad) or the serve profile (no grad)."""
    return run_plan(plan, Profile.TRAIN if train else Profile.SERVE).outputs


__all__ = [
    "DistributionMatching",
    "DMDOptions",
    "BehaviorRecord",
    "Consistency",
    "DataConfig",
    "Dataset",
    "MethodSpec",
    "OptimConfig",
    "ReplayableLoop",
    "Reward",
    "Role",
    "RoleSpec",
    "Rollout",
    "StepRecord",
    "StopRequest",
    "StrictModel",
    "SyncResult",
    "TrainAdapter",
    "TrainConfig",
    "TrainMethod",
    "TrainingStopped",
    "WeightSyncPlan",
    "adapter_class",
    "call_of",
    "check_c2",
    "check_train_device",
    "load_config",
    "load_dataset",
    "load_optimizer",
    "load_records",
    "load_reward",
    "make_optimizer",
    "plot_loss",
    "read_prompts",
    "push_weights",
    "records_equal",
    "replay_call",
    "replay_step",
    "rollout",
    "run_body",
    "same_bits",
    "save_optimizer",
    "save_records",
    "set_lr",
    "sync_weights",
    "train",
    "train_adapter",
    "validate",
    "validate_options",
]
