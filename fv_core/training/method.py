"""What a training method is: the protocol ``fv train`` drives and the spec it declares.

A method (a plugin registered through ``fv_register_methods``) owns its modules and optimisers;
the trainer owns time (when to log, evaluate, checkpoint and stop). Its ``spec`` says which roles it
holds, which components of each role train, the consistency level its losses rest on (the C2 gate
checks it) and the ``BehaviorRecord`` fields it reads from rollouts.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Protocol

import torch


class Role(str, enum.Enum):
    """Which copy of the weights a module plays in a method (what a WeightSyncPlan ships)."""

    STUDENT = "student"  # the weights being optimised
    EMA = "ema"  # exponential moving average of the student; what is exported
    TEACHER = "teacher"  # frozen source of targets (distillation)
    CRITIC = "critic"  # fake-score / reward model trained alongside (DMD2)
    OLD = "old"  # the decay-blended policy that samples rollouts (DiffusionNFT)
    REFERENCE = "reference"  # frozen anchor for KL terms (RL)


class Consistency(str, enum.Enum):
    """The parity rung a method's objective needs between its train and serve forwards."""

    C1 = "C1"  # outputs equal the reference pipeline's (plain regression on data)
    C2_FREE = "C2-free"  # train-forward == serve-forward on the quantity trained on (no likelihoods)
    C2_BASED = "C2-based"  # as C2-free, plus per-step log-probabilities identical


@dataclass(frozen=True, slots=True)
class RoleSpec:
    role: Role
    trains: tuple[str, ...] = ()  # components of this role the optimiser updates ("": frozen)
    holds: tuple[str, ...] = ()  # every component the role keeps a copy of


@dataclass(frozen=True, slots=True)
class MethodSpec:
    roles: tuple[RoleSpec, ...]
    consistency: Consistency
    record_fields: tuple[str, ...] = ()  # BehaviorRecord fields read from rollouts ("" if none)
    devices: tuple[str, ...] = ("cpu",)  # torch device types the method trains on (TrainConfig.device)

    def role(self, role: Role) -> RoleSpec:
        return next(r for r in self.roles if r.role is role)

    def describe(self) -> dict[str, object]:
        """The spec as plain values (``fv train --describe``, provenance)."""
        return {
            "consistency": self.consistency.value,
            "roles": {r.role.value: {"holds": list(r.holds), "trains": list(r.trains)} for r in self.roles},
            "record_fields": list(self.record_fields),
            "devices": list(self.devices),
        }


class TrainMethod(Protocol):
    """What ``fv train`` drives; built by a factory registered under ``fv_register_methods``."""

    spec: ClassVar[MethodSpec]
    roles: dict[Role, dict[str, torch.nn.Module]]  # the live modules of each role (what a sync ships)

    def step(self, step: int) -> dict[str, float]:
        """One optimisation step; returns scalars to log (``loss`` at least)."""
        ...

    def evaluate(self, step: int) -> dict[str, float]:
        """Held-out metrics, cheap enough to run every ``eval_every`` steps."""
        ...

    def save(self, folder: Path) -> None:
        """Write a resumable checkpoint (weights in the real layout, optimiser state)."""
        ...

    def load(self, folder: Path) -> None:
        """Restore what ``save`` wrote."""
        ...

    def export(self, folder: Path) -> None:
        """Write the final, loadable model (EMA weights where the method keeps them)."""
        ...
