"""The flywheel: the NFT-tuned shapes model distilled by DMD2 into a 2-step student, next to its teacher.

Evaluates (``fv eval``'s cell: 128 fixed prompts, the 6 held-out combinations included, guidance 1)
the teacher ``wan2.1-t2v-shapes-nft`` at 30 UniPC steps and the student the run of
``configs/shapes/dmd2_2step_nft.yaml`` exported (``wan2.1-t2v-shapes-2step``'s loop on that run's
``final/`` folder), checks DMD2's targets against this teacher (colour, shape and direction within
0.02; start spread at least 0.8 of the teacher's) and writes bench/results/dmd2_flywheel.json.

    fv train configs/shapes/dmd2_2step_nft.yaml && python bench/dmd2_flywheel.py
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import fv_core
from fv_core.training import load_config
from fv_train_flow.eval import evaluate_model

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs/shapes/dmd2_2step_nft.yaml"
AXES = ("colour", "shape", "direction")
TOLERANCE, SPREAD_RATIO = 0.02, 0.8


def row(report: dict) -> dict:
    """The table's numbers of one ``evaluate_model`` report."""
    everything, held = report["all"], report["held_out"]
    return {
        **report["settings"],
        **{axis: everything[axis] for axis in AXES},
        **{f"held_out_{axis}": held[axis] for axis in AXES},
        "start_spread": everything["start_spread"],
        "seconds_per_video": report["seconds_per_video"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/dmd2_flywheel.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    run = REPO / load_config(CONFIG).output_dir
    teacher = row(evaluate_model(fv_core.load("wan2.1-t2v-shapes-nft"), args.prompts, 30, 1.0, "unipc"))
    student_model = fv_core.load("wan2.1-t2v-shapes-2step", run / "final")
    student = row(evaluate_model(student_model, args.prompts, 2, 1.0, "dmd"))
    report = {
        "teacher": {"card": "wan2.1-t2v-shapes-nft", **teacher},
        "student": {
            "card": "wan2.1-t2v-shapes-2step",
            "weights": str((run / "final").relative_to(REPO)),
            **student,
        },
        "targets": {
            **{axis: abs(student[axis] - teacher[axis]) <= TOLERANCE for axis in AXES},
            "start_spread_ratio": round(student["start_spread"] / teacher["start_spread"], 3),
            "start_spread": student["start_spread"] >= SPREAD_RATIO * teacher["start_spread"],
        },
        "training": json.loads((run / "summary.json").read_text()),
        "recipe": json.loads((run / "final" / "fv_recipe.json").read_text()),
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("teacher", "student", "targets")}, indent=2))


if __name__ == "__main__":
    main()
