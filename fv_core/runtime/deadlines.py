"""Deadlines of real-time sessions: can the instance meet them? (the admission of sessions).

A real-time session makes one chunk per period (``period_s``: frames per chunk / fps). With n sessions
held, each period the instance makes n chunks: their transformer passes batch across the sessions (one
call of n rows, priced by the batch curve of the chunk pass), and so do their decodes (priced by the
decode's batch curve, once measured); the rest of a chunk (prompt, bookkeeping) runs once per session.
The predicted round, every session making one chunk::

    round_s(n) = solo_s * ((1 - batched_share - decode_share) * n
                           + batched_share * curve(n) / curve(1) + decode_share * decode_curve(n) / decode_curve(1))

``solo_s`` is a chunk made alone (measured), ``batched_share`` / ``decode_share`` the parts of it spent
in passes and in the decode that batch. The scheduler runs deadline work earliest deadline first, which meets every deadline whenever
the round fits the tightest period; so a session is admitted only while ``round_s <= headroom x
period_s`` with it counted, and refused otherwise with these numbers instead of letting every session
miss.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

HEADROOM = 0.85  # the share of a period admission lets the predicted round fill (the rest absorbs noise)


@dataclass(slots=True)
class ChunkCost:
    """What one chunk costs on an instance, as measured."""

    solo_s: float  # seconds of one chunk made alone
    batched_share: float = 0.0  # fraction of solo_s in passes that batch across sessions (0..1)
    curve: Callable[[int], float | None] | None = None  # seconds of one batched pass by rows
    decode_share: float = 0.0  # fraction of solo_s in the chunk's decode (0: decodes priced per session)
    decode_curve: Callable[[int], float | None] | None = None  # seconds of one batched decode by rows

    def round_s(self, sessions: int) -> float:
        """Predicted seconds for ``sessions`` sessions to make one chunk each."""
        apart, together = 1.0, 0.0  # shares of solo_s run once per session, and scaled by a curve
        for share, curve in ((self.batched_share, self.curve), (self.decode_share, self.decode_curve)):
            one = curve(1) if curve is not None else None
            many = curve(sessions) if curve is not None else None
            if one and many is not None and share > 0:
                share = min(apart, share)
                apart, together = apart - share, together + share * many / one
        return self.solo_s * (apart * sessions + together)


@dataclass(slots=True)
class DeadlineLoad:
    """The predicted load of a set of sessions on one instance."""

    sessions: int  # sessions held, the one asked for included
    period_s: float  # the tightest session's chunk period
    round_s: float  # predicted seconds for every session to make one chunk
    headroom: float = HEADROOM

    @property
    def load(self) -> float:
        """Predicted round over the period (above ``headroom``: deadlines are missed)."""
        return self.round_s / self.period_s

    @property
    def fits(self) -> bool:
        return self.round_s <= self.headroom * self.period_s

    def as_dict(self) -> dict[str, float]:
        return {"sessions": self.sessions, "period_s": self.period_s, "round_s": self.round_s,
                "load": self.load, "headroom": self.headroom}  # fmt: skip


def predict_load(periods: list[float], cost: ChunkCost, headroom: float = HEADROOM) -> DeadlineLoad:
    """The load of sessions with these chunk periods (the new one included)."""
    return DeadlineLoad(len(periods), min(periods), cost.round_s(len(periods)), headroom)


def most_sessions(period_s: float, cost: ChunkCost, headroom: float = HEADROOM, limit: int = 1024) -> int:
    """How many sessions of this period the instance holds (0: not even one)."""
    n = 0
    while n < limit and cost.round_s(n + 1) <= headroom * period_s:
        n += 1
    return n


def refusal(load: DeadlineLoad, fps: float, frames_per_chunk: int, cost: ChunkCost) -> str:
    """Why a session is refused: the predicted numbers, the load and the fix."""
    held = load.sessions - 1
    fit_fps = frames_per_chunk * load.headroom / cost.round_s(load.sessions)
    room = most_sessions(frames_per_chunk / fps, cost, load.headroom)
    return (
        f"fps={fps:g} cannot be held: with {held} session(s) already held, {load.sessions} sessions predict "
        f"{load.round_s:.3f} s to make one chunk each (a chunk alone: {cost.solo_s:.3f} s) against a chunk "
        f"deadline of {load.period_s:.3f} s ({frames_per_chunk} frames per chunk), a load of {load.load:.2f} "
        f"(at most {load.headroom:.2f} is admitted), so every session would miss its deadlines. This "
        f"instance holds {room} session(s) at fps={fps:g}. Fix: ask for fps <= {fit_fps:.1f}, close a "
        "session, or open it on another replica."
    )
