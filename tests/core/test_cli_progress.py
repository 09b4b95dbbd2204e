"""`fv generate`'s progress through the real CLI (a subprocess, stderr a pipe): plain lines without escape
codes or carriage returns, nothing before the first step, stage labels for multi-stage tasks, a line per
streamed chunk, and a final line listing every file written. On a terminal: one line redrawn in place."""

from __future__ import annotations

import io
import re
import subprocess
import sys

import pytest

from fv_core.loop.contracts import StreamEvent
from fv_core.progress import RunProgress, files_line


@pytest.fixture(autouse=True)
def _dirs(tmp_path, monkeypatch):
    monkeypatch.setenv("FV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)


def _fv(*argv: str) -> tuple[list[str], list[str]]:
    run = subprocess.run(
        [sys.executable, "-m", "fv_core.cli", "generate", *argv, "--prompt", "a cat", "--seed", "1"],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    for text in (run.stdout, run.stderr):
        assert "\x1b[" not in text and "\r" not in text  # no escape codes, no redraws in a pipe
    return run.stdout.splitlines(), run.stderr.splitlines()


def test_two_stage_task_labels_its_stages_and_lists_the_sound_file():
    out, err = _fv("--model", "ltx2-tiny", "--task", "t2av-two-stage", "--audio-out", "a.wav")
    steps = [line for line in err if line.startswith("ltx2-tiny t2av-two-stage: ")]
    assert steps and steps == err  # nothing else on stderr: no loader bars, no empty bar before work
    assert steps[0].endswith("t2av 0/4 — encode prompt")  # the first line is the first step
    assert any(" t2av 4/4 · upsample — latent upsample x2" in line for line in steps)
    assert any(" t2av 4/4 · upsample · refine 2/3 — denoise 2/3" in line for line in steps)
    assert re.fullmatch(r"wrote out\.mp4, out\.json and a\.wav in \d+\.\d s", out[-1]), out


def test_think_lists_the_image_its_provenance_and_its_thinking():
    out, err = _fv("--model", "bagel-tiny", "--task", "think-t2i", "-o", "think.png")
    assert any(re.search(r": think \d+ steps · t2i 3/\d+ — denoise 3/", line) for line in err), err
    assert re.fullmatch(r"wrote think\.png, think\.json and think\.txt in \d+\.\d s", out[-1]), out


def test_stream_prints_a_line_per_chunk():
    out, err = _fv("--model", "wan2.1-t2v-tiny-causal", "--stream", "-o", "s.mp4")
    chunks = [line for line in err if "streamed into s.mp4" in line]
    assert chunks == [
        "wan2.1-t2v-tiny-causal t2v: chunk of 1 frame streamed into s.mp4 (1 frames so far)",
        "wan2.1-t2v-tiny-causal t2v: chunk of 4 frames streamed into s.mp4 (5 frames so far)",
        "wan2.1-t2v-tiny-causal t2v: chunk of 4 frames streamed into s.mp4 (9 frames so far)",
    ]
    assert out[-1].startswith("wrote s.mp4 and s.json in ")


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_one_line_is_redrawn_and_a_chunk_line_goes_above_it():
    term = Terminal()
    shown = RunProgress("m t", ["base", "refine"], term)
    assert term.getvalue() == ""  # nothing before the first step
    for step, total, label in [(1, 4, "a"), (4, 4, "b"), (1, 2, "c")]:
        shown.event(StreamEvent("progress", "r", step, total, label))
    shown.chunk(4, 4, "o.mp4")
    shown.close()
    lines = term.getvalue().split("\n")
    assert lines[0].split("\r")[1:] == [
        "m t: base 1/4 — a",
        "m t: base 4/4 — b",
        "m t: base 4/4 · refine 1/2 — c",
        "m t: chunk of 4 frames streamed into o.mp4 (4 frames so far)",  # over the line, then a newline
    ]
    assert lines[1:] == ["\rm t: base 4/4 · refine 1/2 — c", ""]  # redrawn below it, ended by close


def test_files_line():
    assert files_line(["a.png"], 1.25) == "wrote a.png in 1.2 s"
    assert files_line(["a.png", "a.json", "a.txt"], 2) == "wrote a.png, a.json and a.txt in 2.0 s"
