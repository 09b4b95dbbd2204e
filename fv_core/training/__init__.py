"""The training seam: roles a method trains or reads, and running a serve step body under grad.

Training methods (plugins registered through ``fv_register_methods``) build the same ``WorkPlan``
bodies the serve loops run and execute them here under ``Profile.TRAIN``: one implementation of
the model and the sampler for serving, rollout and training. The runtime never imports this.
"""

from __future__ import annotations

import enum
from typing import Any

from fv_core.loop.contracts import Profile, WorkPlan
from fv_core.loop.runner import run_plan


class Role(str, enum.Enum):
    """Which copy of the weights a module plays in a method (what a WeightSyncPlan ships)."""

    STUDENT = "student"  # the weights being optimised
    EMA = "ema"  # exponential moving average of the student; what is exported
    TEACHER = "teacher"  # frozen source of targets (distillation)
    CRITIC = "critic"  # fake-score / reward model trained alongside (DMD2)
    REFERENCE = "reference"  # frozen anchor for KL or old-policy terms (RL)


def train_body(plan: WorkPlan) -> dict[str, Any]:
    """Outputs of ``plan.body(plan.inputs)`` with grad enabled (the train profile)."""
    return run_plan(plan, Profile.TRAIN).outputs


__all__ = ["Role", "train_body"]
