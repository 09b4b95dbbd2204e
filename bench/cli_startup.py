"""Start-up time of `fv` commands, each run as a fresh process: min and median of repeats.

    python bench/cli_startup.py [--repeats 5] [--cwd DIR] [--label after] [--out bench/results/cli_startup.json]

``--cwd`` times another checkout (e.g. a ``git worktree`` of an earlier commit: python -m fv_core.cli run
from there imports its fv_core); results of each ``--label`` are merged into the JSON file.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

COMMANDS = [
    ["--help"],
    ["plugins"],
    ["generate", "--help"],
    ["generate", "--model", "wan2.1-t2v-tiny", "--help"],
    ["validate", "examples/deploy/wan-shapes.yaml"],
]


def timed(cmd: list[str], cwd: str | None) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, cwd=cwd, capture_output=True, check=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cwd", help="run from this checkout (its fv_core is imported first)")
    parser.add_argument("--label", default="after")
    parser.add_argument("--out", default="bench/results/cli_startup.json")
    args = parser.parse_args()
    results: dict = {
        "load_average_1min": {"start": round(os.getloadavg()[0], 2)}
    }  # other jobs on the machine
    for command in COMMANDS:
        seconds = [
            timed([sys.executable, "-m", "fv_core.cli", *command], args.cwd) for _ in range(args.repeats)
        ]
        results["fv " + " ".join(command)] = {
            "min_s": round(min(seconds), 3),
            "median_s": round(statistics.median(seconds), 3),
            "repeats": args.repeats,
        }
        print(f"{args.label}: fv {' '.join(command)}: {results['fv ' + ' '.join(command)]}", flush=True)
    results["load_average_1min"]["end"] = round(os.getloadavg()[0], 2)
    out = Path(args.out)
    merged = json.loads(out.read_text()) if out.exists() else {}
    merged[args.label] = results
    out.write_text(json.dumps(merged, indent=2) + "\n")


if __name__ == "__main__":
    main()
