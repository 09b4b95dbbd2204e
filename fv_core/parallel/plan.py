"""ParallelPlan: how one model instance spreads over a group of processes, validated before any starts.

Axes (their names in plan strings and in a card's ``parallelism.axes`` contract):

    data     ``dp``   rows of a batch on different ranks (a group holds one; replicas scale data)
    sequence ``sp``   Ulysses: tokens sharded, heads sharded around self-attention
    cfg      ``cfg``  the guidance branches of a step on different ranks (contract axis ``cfgp``)
    tensor   ``tp``   representable, not implemented yet

Ranks are laid out sequence-innermost: ``rank = (data * cfg_degree + cfg) * sp_degree + sp``, so the
ranks of one Ulysses group are neighbours (one NVLink island on a GPU machine).
"""

from __future__ import annotations

from dataclasses import dataclass

from fv_core.errors import ConfigError

AXES = {"dp": "data", "sp": "sequence", "cfg": "cfg", "tp": "tensor"}  # plan string name -> field
CONTRACT_AXES = {"data": "dp", "sequence": "sp", "cfg": "cfgp", "tensor": "tp"}  # field -> card contract axis


@dataclass(frozen=True, slots=True)
class ParallelPlan:
    """Degrees of each axis; the product is the group's world size."""

    data: int = 1  # data-parallel degree
    sequence: int = 1  # Ulysses sequence-parallel degree
    cfg: int = 1  # CFG-parallel degree (guidance branches on different ranks)
    tensor: int = 1  # tensor-parallel degree (not implemented: must be 1)

    @property
    def world_size(self) -> int:
        return self.data * self.sequence * self.cfg * self.tensor

    @property
    def id(self) -> str:
        """Stable text for batch keys and provenance: ``"single"`` or e.g. ``"sp=2,cfg=2"``."""
        parts = [f"{name}={getattr(self, field)}" for name, field in AXES.items() if getattr(self, field) > 1]
        return ",".join(parts) or "single"

    @property
    def is_single(self) -> bool:
        return self.world_size == 1

    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(data, cfg, sequence)`` indices of ``rank``."""
        sp, rest = rank % self.sequence, rank // self.sequence
        return rest // self.cfg, rest % self.cfg, sp

    @classmethod
    def parse(cls, text: str | None) -> ParallelPlan:
        """``"sp=2,cfg=2"`` (also ``dp=``, ``tp=``); ``None``, ``""`` or ``"single"`` is one process."""
        if text is None or text.strip() in ("", "single"):
            return cls()
        degrees: dict[str, int] = {}
        for item in text.split(","):
            name, _, value = item.strip().partition("=")
            if name not in AXES or not value.strip().isdigit() or int(value) < 1:
                raise ConfigError(
                    f"parallel plan {text!r}: {item.strip()!r} is not AXIS=DEGREE with AXIS one of "
                    f"{sorted(AXES)} and DEGREE >= 1. Fix: e.g. 'sp=2,cfg=2'."
                )
            if AXES[name] in degrees:
                raise ConfigError(f"parallel plan {text!r} names {name!r} twice. Fix: name each axis once.")
            degrees[AXES[name]] = int(value)
        return cls(**degrees)


def plan_problems(
    plan: ParallelPlan,
    *,
    card_axes: dict[str, int],
    heads: int,
    branches: int,
    devices: int,
    device: str,
) -> list[str]:
    """Everything wrong with running ``plan``, each with its numbers and a fix (empty: runnable).

    :param card_axes: the card's ``parallelism.axes`` (contract axis -> max degree)
    :param heads: attention heads per layer (Ulysses shards them)
    :param branches: guidance branches of a step (2 under CFG)
    :param devices: devices of ``device``'s type this machine has (CPU: processes it may start)
    """
    problems = []
    for field, axis in CONTRACT_AXES.items():
        degree, most = getattr(plan, field), card_axes.get(axis, 1)
        if degree > most:
            problems.append(
                f"{field} degree {degree} exceeds the card's maximum {most} (parallelism.axes.{axis}). "
                f"Fix: use {axis if axis != 'cfgp' else 'cfg'}<={most}."
            )
    if plan.tensor > 1:
        problems.append(f"tensor degree {plan.tensor}: tensor parallelism is not implemented. Fix: tp=1.")
    if heads % plan.sequence:
        problems.append(
            f"sequence degree {plan.sequence} does not divide the {heads} attention heads "
            f"(Ulysses gives each rank heads/{plan.sequence}). Fix: use an sp that divides {heads}."
        )
    if plan.cfg > branches:
        problems.append(
            f"cfg degree {plan.cfg} exceeds the {branches} guidance branch(es) of a step. Fix: cfg<={branches}."
        )
    if plan.world_size > devices:
        problems.append(
            f"world size {plan.world_size} (= dp {plan.data} x cfg {plan.cfg} x sp {plan.sequence} x "
            f"tp {plan.tensor}) exceeds the {devices} {device} device(s) available. Fix: lower the degrees."
        )
    return problems
