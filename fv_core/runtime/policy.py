"""Scheduling policies: which WorkUnits run in a tick, decided from the cost model.

- ``fair``: every running request's next step each tick, least recently served first, compatible
  steps batched (time-sharing).
- ``fifo``: request-level FIFO: the oldest admitted request's steps, alone, until it finishes.
- ``auto``: one call per tick. Its lead is the request with the least predicted remaining seconds
  (SRPT; switching lead at a step boundary is a preemption, and it lowers predicted mean latency
  exactly when the new lead has less work left), unless a request is late: its age plus its
  remaining work reaches ``max_wait_factor`` x its predicted solo time, or it has not run a step
  ``ttfs_target_s`` after it arrived; then the late request leads, earliest deadline first, and keeps
  the lead until it is done (the bound holds while the load leaves room for it). The lead's compatible
  peers (equal batch keys) join its call only while the batch curve predicts the batched call to
  cost at least ``margin`` less than its rows run apart. A curve with no batched measurement is
  probed with two rows, and re-probed after ``probe_every`` calls alone, so the curve is measured,
  never assumed. A call's rows stay below the rows of its key that ran out of memory, and within the
  memory the budget leaves beside the resident instances at the measured peak per row.

Deadline work (a real-time session's chunk, submitted with a ``deadline``: the wall-clock time by
which its frames must be out) goes first under every policy, earliest deadline first (EDF): ``fair``
orders its calls by deadline, ``fifo`` serves the earliest deadline before the oldest request, and
``auto`` makes the earliest deadline its lead, its compatible peers (deadline work first, by
deadline) joining its call as the batch curve allows. EDF meets every deadline whenever any order
can on one server, so the load admission lets in (``fv_core.runtime.deadlines``) is what decides.

Ages, remaining work and solo times are counted in one currency, the scheduler's clock: the predicted
seconds of the calls it ran (a batch curve's where measured, else the calibrated plans), so a decision
depends on the cost model's predictions only, never on the wall time of the tick it is made in.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, Literal

from fv_core.errors import ConfigError
from fv_core.runtime.cost import CostModel

POLICIES = ("auto", "fifo", "fair")


@dataclass(slots=True)
class SchedulingPolicy:
    """How a scheduler picks work (the deploy file's ``scheduling`` section)."""

    policy: Literal["auto", "fifo", "fair"] = "fair"  # see the module docstring
    max_wait_factor: float = 4.0  # auto: a request is done within this x its predicted solo time
    ttfs_target_s: float | None = None  # auto: a request runs its first step within this (None: no target)
    margin: float = 0.1  # auto: batch when the batched call costs <= (1 - margin) x its rows apart
    probe_every: int = 64  # auto: calls alone of a batch key between two probes of its batch curve

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(
                f"scheduling policy {self.policy!r} is unknown. Fix: use one of {list(POLICIES)}."
            )
        if self.max_wait_factor < 1:
            raise ConfigError(
                f"scheduling max_wait_factor={self.max_wait_factor} is below 1: no request can finish "
                "before its own solo time. Fix: use a factor >= 1 (default 4)."
            )

    def due(self, arrived: float, solo_s: float, remaining_s: float, started: bool) -> float:
        """The clock at which a request becomes late: its age plus its remaining work reach
        max_wait_factor x its solo time, or (not started yet) its age reaches ttfs_target_s."""
        due = arrived + self.max_wait_factor * solo_s - remaining_s
        return due if started or self.ttfs_target_s is None else min(due, arrived + self.ttfs_target_s)

    @classmethod
    def from_settings(cls, settings: Any) -> SchedulingPolicy:
        """From an object with ``policy``, ``max_wait_factor`` and ``ttfs_target_s`` (a deploy's section)."""
        if settings is None or isinstance(settings, cls):
            return settings or cls()
        return cls(settings.policy, settings.max_wait_factor, settings.ttfs_target_s)


@dataclass(slots=True)
class Candidate:
    """A running request's next step, priced for a decision."""

    entry: Any  # the scheduler's Entry
    key: Hashable | None  # batch curve key of its plan (None: never batched)
    rows: int  # rows its plan adds to a call
    step_s: float  # predicted seconds of its next step alone (CostModel.solo_s)
    remaining_s: float  # predicted seconds of all its remaining work alone
    due: float  # scheduler clock at which it becomes late (see the module docstring)
    seq: int  # submit order (tie-break)
    deadline: float | None = None  # wall-clock time its work is due (None: no deadline)


@dataclass(slots=True)
class Decisions:
    """What the scheduler decided, counted (exported as metrics)."""

    batch: int = 0  # calls of two or more requests' steps
    alone: int = 0  # calls of one request's step
    preempt: int = 0  # auto: the lead changed while the previous lead still had work
    probe: int = 0  # auto: batched calls made to measure the batch curve (counted in batch too)
    late: int = 0  # auto: calls led by a late request (aging bound or time-to-first-step target)
    split: int = 0  # batched calls that ran out of memory and were retried row by row

    def as_dict(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in self.__slots__}


def edf_key(item: Any) -> tuple[bool, float, int]:
    """Sort key of a Candidate or scheduler Entry: deadline work first, earliest deadline first, then
    submit order."""
    return (item.deadline is None, item.deadline if item.deadline is not None else 0.0, item.seq)


def pick_auto(
    cands: list[Candidate],
    cost: CostModel,
    policy: SchedulingPolicy,
    clock: float,
    last: Any,
    max_rows: int,
    headroom_bytes: float = math.inf,
) -> tuple[list[Candidate], str]:
    """The call to make: the lead first, then the peers that join it; and why (alone / batch / probe).
    Its rows stay within ``max_rows`` and the lead's learned row limit (``CostModel.row_limit``: below rows
    that ran out of memory, and within ``headroom_bytes`` at the measured peak per row)."""
    timed = [c for c in cands if c.deadline is not None]
    late = [c for c in cands if c.due <= clock]
    if timed:  # deadline work first, earliest deadline first
        lead = min(timed, key=edf_key)
    elif late:  # a late lead keeps the lead until it is done: late requests are not preempted
        lead = min(late, key=lambda c: (c.entry is not last, c.due, c.seq))
    else:  # ties keep the lead of the last call: no preemption that gains nothing
        lead = min(cands, key=lambda c: (c.remaining_s, c.entry is not last, c.seq))
    peers = sorted(
        (c for c in cands if c is not lead and c.key is not None and c.key == lead.key),
        key=lambda c: (*edf_key(c)[:2], c.remaining_s, c.seq),
    )
    max_rows = min(max_rows, cost.row_limit(lead.key, headroom_bytes) or max_rows)
    peers = [c for c in peers if lead.rows + c.rows <= max_rows]
    if not peers:
        return [lead], "alone"
    curve = cost.curve(lead.key)
    if not curve.batched() or curve.alone_since_batch >= policy.probe_every:
        return [lead, peers[0]], "probe"
    call, best = [lead], [lead]
    rows, apart = lead.rows, lead.step_s
    for peer in peers:
        if rows + peer.rows > max_rows:
            break
        call.append(peer)
        rows, apart = rows + peer.rows, apart + peer.step_s
        batched = cost.batch_cost(lead.key, rows)
        if batched is not None and batched <= (1 - policy.margin) * apart:
            best = list(call)
    return best, "batch" if len(best) > 1 else "alone"
