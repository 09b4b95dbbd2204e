"""What a run shows while it works: its stages with their steps (``t2av 4/4 · upsample · refine 2/3``)
and each streamed chunk, drawn on one line on a terminal and as plain lines (no escape codes, no
carriage returns) anywhere else. Nothing is shown before the first step.

A program's stages run one after another, each loop counting its own steps, so a new stage is seen
where the step count goes back or its total changes.
"""

from __future__ import annotations

import shutil
import sys
from typing import Any, TextIO


class RunProgress:
    """Progress of one run of ``stages`` (a task's loop ids), written to ``out`` (default: stderr)."""

    def __init__(self, prefix: str, stages: list[str], out: TextIO | None = None) -> None:
        self.prefix, self.stages = prefix, stages
        self.out = out or sys.stderr
        self.tty = self.out.isatty()
        self.done: list[str] = []  # finished stages, as shown
        self.stage = -1  # index of the stage running (-1: no step yet)
        self.step, self.total, self.label = 0, None, ""  # the running stage's last event
        self.drawn = 0  # length of the line drawn on the terminal (0: none)

    def event(self, event: Any) -> None:
        """Fold in a run's stream event (``LoadedModel.generate(on_event=...)``)."""
        if event.kind != "progress":
            return
        new = self.stage < 0 or event.total != self.total or event.step < self.step
        if new and self.stage >= 0:
            self.done.append(self._current())
        shown = (self.stage, self.step)
        self.stage += new
        self.step, self.total, self.label = event.step, event.total, str(event.data or "")
        if self.tty:
            self._draw(self.line())
        elif (self.stage, self.step) != shown:  # a plain line per step, not per work unit
            print(self.line(), file=self.out, flush=True)

    def chunk(self, frames: int, written: int, path: Any) -> None:
        """A line for a streamed chunk of ``frames`` frames (``written`` in ``path`` so far)."""
        counted = f"{frames} frame" + "s" * (frames != 1)
        self._say(f"{self.prefix}: chunk of {counted} streamed into {path} ({written} frames so far)")

    def close(self) -> None:
        """End the terminal line, keeping the stages it shows."""
        if self.drawn:
            print(file=self.out, flush=True)
            self.drawn = 0

    def line(self) -> str:
        """``prefix: done · done · current — the current step's label``."""
        line = f"{self.prefix}: " + " · ".join([*self.done, self._current()])
        return f"{line} — {self.label}" if self.label else line

    def _current(self) -> str:
        name = self.stages[self.stage] if self.stage < len(self.stages) else f"stage {self.stage + 1}"
        if self.total is None:
            return f"{name} {self.step} steps" if self.step else name
        return name if self.total <= 1 else f"{name} {self.step}/{self.total}"

    def _draw(self, line: str) -> None:
        """Redraw the terminal line: cut to the width (a wrapped line cannot be redrawn), padded over the last."""
        line = line[: shutil.get_terminal_size().columns - 1]
        print("\r" + line.ljust(self.drawn), end="", file=self.out, flush=True)
        self.drawn = len(line)

    def _say(self, text: str) -> None:
        """A line of its own, above the terminal line when one is drawn."""
        if self.drawn:
            print("\r" + text.ljust(self.drawn), file=self.out, flush=True)
            self._draw(self.line())
        else:
            print(text, file=self.out, flush=True)


class WorkflowProgress:
    """Progress of a workflow's stages, one :class:`RunProgress` each
    (``t2i-to-i2v stage 2/2 motion: wan-i2v i2v 14/30``)."""

    def __init__(self, workflow_id: str, out: TextIO | None = None) -> None:
        self.workflow_id, self.out = workflow_id, out
        self.stage: Any = None  # the StageRun shown
        self.shown: RunProgress | None = None

    def event(self, stage: Any, event: Any) -> None:
        """Fold in a stage's stream event (``LoadedWorkflow.generate(on_event=...)``)."""
        if stage is not self.stage or self.shown is None:
            self.close()
            self.stage = stage
            label = f"{stage.model} {stage.requests[0].task}"
            self.shown = RunProgress(f"{self.workflow_id} stage {stage.where}", [label], self.out)
        self.shown.event(event)

    def close(self) -> None:
        if self.shown is not None:
            self.shown.close()


def files_line(paths: list[Any], seconds: float) -> str:
    """``wrote a.png, a.json and a.txt in 1.2 s``."""
    names = [str(p) for p in paths]
    listed = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
    return f"wrote {listed} in {seconds:.1f} s"
