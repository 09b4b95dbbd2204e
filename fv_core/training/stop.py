"""Stopping a training run by signal without losing it.

The first SIGINT (Ctrl-C) or SIGTERM asks the trainer to save a checkpoint at the next step boundary
and stop (:class:`TrainingStopped`); a second one stops at once (``KeyboardInterrupt``). Checkpoints
are written to a staging folder and renamed, so a stop in the middle of a save leaves the earlier
checkpoints as they were.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path


class StopRequest:
    """While entered, SIGINT and SIGTERM set :attr:`signal` (their name) instead of killing the process."""

    def __init__(self) -> None:
        self.signal: str | None = None
        self._previous: dict[signal.Signals, object] = {}

    def __enter__(self) -> StopRequest:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]

    def _handle(self, signum: int, frame: object) -> None:
        if self.signal is not None:
            raise KeyboardInterrupt
        self.signal = signal.Signals(signum).name
        print(
            f"\n{self.signal}: saving a checkpoint after this step, then stopping "
            f"(a second {self.signal} stops at once, without saving)",
            file=sys.stderr,
            flush=True,
        )


class TrainingStopped(Exception):
    """The run stopped on a signal after saving ``checkpoint`` (the state after ``step`` steps)."""

    def __init__(self, signal_name: str, step: int, checkpoint: Path) -> None:
        super().__init__(f"stopped by {signal_name} after step {step}; saved {checkpoint}")
        self.signal, self.step, self.checkpoint = signal_name, step, checkpoint

    @property
    def exit_code(self) -> int:
        """128 + the signal's number, as a shell reports a process the signal ended."""
        return 128 + signal.Signals[self.signal].value
