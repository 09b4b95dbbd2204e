"""DMD2 students of the shapes model next to their teacher, in one ``fv eval`` run.

Evaluates (``fv_train_flow.eval.evaluate_model``, ``fv eval``'s cell: 128 fixed prompts, the 6 held-out
combinations included, guidance 1) the teacher ``wan2.1-t2v-shapes`` at 30 UniPC steps and the students
``wan2.1-t2v-shapes-2step`` / ``-1step`` with their ``dmd`` sampler, checks the targets (colour, shape
and direction within 0.02 of the teacher; start spread at least 0.8 of the teacher's), measures
single-video latency, repeats the targets on a larger prompt set (``--check-prompts``: the same 128 and
more seeds of the same combinations; 128 prompts read shape within about +-0.03), reads the training
summaries and writes bench/results/dmd2_shapes.json and
docs/shapes-2step-strip.png / docs/shapes-1step-strip.png. Run after both trainings and shipping:

    fv train configs/shapes/dmd2_2step.yaml && fv train configs/shapes/dmd2_1step.yaml
    python bench/dmd2_shapes.py
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from fv_train_flow import shapes
from fv_train_flow.eval import evaluate_model, load

REPO = Path(__file__).resolve().parents[1]
TEACHER = ("wan2.1-t2v-shapes", "unipc", 30)
STUDENTS = (("wan2.1-t2v-shapes-2step", "dmd", 2), ("wan2.1-t2v-shapes-1step", "dmd", 1))
AXES = ("colour", "shape", "direction")
TOLERANCE, SPREAD_RATIO = 0.02, 0.8


def single_video_seconds(model, repeats: int = 3) -> float:
    """Median latency of one unbatched generate call at the card's defaults."""
    model.generate(prompt="a green square moving up")  # warm-up
    runs = sorted(
        model.generate(prompt="a green square moving up", seed=i).provenance["seconds"]
        for i in range(repeats)
    )
    return runs[repeats // 2]


def training(steps: int) -> dict | None:
    """The run's summary (wall time, steps, last log) and seconds per step."""
    path = REPO / f"fv-data/runs/shapes-dmd2-{steps}step/summary.json"
    if not path.is_file():
        return None
    summary = json.loads(path.read_text())
    summary["seconds_per_step"] = round(
        summary["wall_s"] / max(1, summary["steps"] - summary["resumed_from"]), 3
    )
    summary["config"] = f"configs/shapes/dmd2_{steps}step.yaml"
    return summary


def row(card: str, report: dict, single: float) -> dict:
    out = {"card": card, **report["settings"]}
    for group in ("all", "held_out"):
        for key in (*AXES, "joint", "start_spread"):
            out[f"{group}_{key}"] = report[group][key]
    out["seconds_per_video_batched"] = report["seconds_per_video"]
    out["seconds_single_video"] = single
    return out


def targets(teacher: dict, student: dict) -> dict:
    """Differences from the teacher per axis (all prompts) and whether each target holds."""
    out = {}
    for axis in AXES:
        delta = round(student[f"all_{axis}"] - teacher[f"all_{axis}"], 4)
        out[axis] = {
            "delta": delta,
            "within_0.02": abs(delta) <= TOLERANCE,
            "not_below_by_0.02": delta >= -TOLERANCE,
        }
    ratio = round(student["all_start_spread"] / max(teacher["all_start_spread"], 1e-9), 3)
    out["start_spread_ratio"] = {"ratio": ratio, "at_least_0.8": ratio >= SPREAD_RATIO}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument(
        "--check-prompts",
        type=int,
        default=384,
        help="a second, larger prompt set (the first --prompts and more seeds of the same combinations): "
        "do the table's results hold beyond its prompts? (0: skip)",
    )
    parser.add_argument("--out", default=str(REPO / "bench/results/dmd2_shapes.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows, reports, baselines, check_rows = [], [], [], []
    teacher_weights = load(TEACHER[0], None).weights
    for card, sampler, steps in (TEACHER, *STUDENTS):
        model = load(card, None)
        strip = REPO / f"docs/shapes-{steps}step-strip.png" if sampler == "dmd" else None
        report = evaluate_model(model, args.prompts, steps, 1.0, sampler, strip=strip)
        reports.append({"card": card, **report})
        rows.append(row(card, report, single_video_seconds(model)))
        print(json.dumps(rows[-1]))
        if args.check_prompts:
            check_rows.append(row(card, evaluate_model(model, args.check_prompts, steps, 1.0, sampler), 0.0))
            print(json.dumps(check_rows[-1]))
        if sampler == "dmd":  # what distillation adds: the undistilled teacher on the student's loop
            base = load(card, teacher_weights)
            report = evaluate_model(base, args.prompts, steps, 1.0, sampler)
            baselines.append(row(f"{card} loop, teacher weights (no distillation)", report, 0.0))
            print(json.dumps(baselines[-1]))
    result = {
        "teacher": TEACHER[0],
        "torch_threads": 1,
        "held_out_combinations": sorted(map(list, shapes.HELD_OUT)),
        "table": rows,
        "targets": {r["card"]: targets(rows[0], r) for r in rows[1:]},
        "check": {
            "prompts": args.check_prompts,
            "table": check_rows,
            "targets": {r["card"]: targets(check_rows[0], r) for r in check_rows[1:]},
        }
        if check_rows
        else None,
        "baselines_teacher_weights_on_student_loops": baselines,
        "training": {f"{s}step": training(s) for _, _, s in STUDENTS},
        "results": reports,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"targets": result["targets"], "check": result["check"]}, indent=2))


if __name__ == "__main__":
    main()
