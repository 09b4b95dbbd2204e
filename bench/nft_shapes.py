"""DiffusionNFT on the shapes model: C4 quality of the parent, the NFT model and the constant-reward
control, and the training curves.

Evaluates each model with ``fv eval``'s fixed prompt set (128 prompts per cell, the six held-out
combinations included) at 30 UniPC steps, guidance 1 and 4, reads both runs' ``log.jsonl`` (rollout
reward per step, the periodic evals) and ``summary.json``, and writes bench/results/nft_shapes.json and
bench/results/nft_shapes.png.

    fv train configs/shapes/nft.yaml && fv train configs/shapes/nft_control.yaml --steps 40
    python bench/nft_shapes.py
    python bench/nft_shapes.py --reuse parent=report.json   # an `fv eval -o` report of a model
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from fv_core.training import load_config
from fv_train_flow.eval import evaluate_grid, load

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench/results"
TARGETS = {"held_out_shape@g1": 0.95, "shape@g4": 0.90, "start_spread_ratio": 0.8}


def run_log(config: Path | None, run: Path | None = None) -> dict[str, Any]:
    """A run's per-step scalars, its evals and its summary (if it finished): the run of ``config``,
    or the output folder ``run`` of an earlier attempt."""
    if run is None:
        assert config is not None
        run = REPO / load_config(config).output_dir
    rows = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines() if line.strip()]
    summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").is_file() else None
    steps = [r for r in rows if "loss" in r]
    return {
        "config": str(config.relative_to(REPO)) if config else None,
        "output_dir": str(run.relative_to(REPO)) if run.is_relative_to(REPO) else str(run),
        "steps_done": steps[-1]["step"] if steps else 0,
        "wall_s": steps[-1]["time_s"] if steps else None,
        "seconds_per_step": round(steps[-1]["time_s"] / steps[-1]["step"], 2) if steps else None,
        "summary": summary,
        "curve": [
            {k: r[k] for k in ("step", "reward", "reward_std", "loss_kl", "grad_norm", "eta") if k in r}
            for r in steps
        ],
        "evals": [{"step": r["step"], **r["eval"]} for r in rows if "eval" in r],
    }


def table(report: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for cell in report["results"]:
        rows.append({
            "guidance": cell["settings"]["guidance"],
            "steps": cell["settings"]["steps"],
            **{k: cell["all"][k] for k in ("colour", "shape", "direction", "joint", "start_spread")},
            **{f"held_out_{k}": cell["held_out"][k] for k in ("colour", "shape", "direction", "start_spread")},
            "square_fill_median": cell["all"]["square_fill_median"],
            "circle_fill_median": cell["all"]["circle_fill_median"],
            "real_start_spread": cell["real_start_spread"],
            "seconds_per_video": cell["seconds_per_video"],
        })  # fmt: skip
    return rows


def verdict(parent: list[dict], model: list[dict]) -> dict[str, Any]:
    """The targets against ``model``'s table (``parent``'s for the spread and the no-loss checks)."""
    g1 = {r["guidance"]: r for r in model}[1.0]
    g4 = {r["guidance"]: r for r in model}[4.0]
    p = {r["guidance"]: r for r in parent}
    out = {
        "held_out_shape@g1": g1["held_out_shape"],
        "shape@g4": g4["shape"],
        "start_spread_ratio": round(
            min(r["start_spread"] / p[r["guidance"]]["start_spread"] for r in model), 3
        ),
        "colour_kept": all(r["colour"] >= p[r["guidance"]]["colour"] - 0.02 for r in model),
        "direction_kept": all(r["direction"] >= p[r["guidance"]]["direction"] - 0.02 for r in model),
    }
    out["met"] = {k: out[k] >= v for k, v in TARGETS.items()}
    out["shortfall"] = {k: round(v - out[k], 4) for k, v in TARGETS.items() if out[k] < v}
    return out


def plot(runs: dict[str, dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    for name, run in runs.items():
        pts = [(r["step"], r["reward"]) for r in run["curve"]]
        if pts:
            xs, ys = zip(*pts, strict=True)
            k = 10
            smooth = [
                sum(ys[max(0, i - k + 1) : i + 1]) / len(ys[max(0, i - k + 1) : i + 1])
                for i in range(len(ys))
            ]
            ax1.plot(xs, ys, alpha=0.25)
            ax1.plot(xs, smooth, label=f"{name} (10-step mean)", color=ax1.lines[-1].get_color())
        for key, style in (("shape_acc@g1", "-o"), ("shape_acc@g4", "--s")):
            ev = [(e["step"], e[key]) for e in run["evals"] if key in e]
            if ev:
                ax2.plot(*zip(*ev, strict=True), style, label=f"{name} {key.replace('_acc', '')}")
    ax1.set_title(
        "rollout reward (old policy, 10 steps; no CFG but attempt_cfg_*: half at guidance 4)", fontsize=9
    )
    ax1.set_xlabel("NFT step")
    ax1.legend(fontsize=7)
    ax2.set_title("shape accuracy, 48 combinations x 1 seed, 30 steps")
    ax2.set_xlabel("NFT step")
    ax2.legend(fontsize=7)
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nft", default=str(REPO / "configs/shapes/nft.yaml"))
    ap.add_argument("--control", default=str(REPO / "configs/shapes/nft_control.yaml"))
    ap.add_argument("--nft-weights", help="NFT model folder (default: the wan2.1-t2v-shapes-nft card's)")
    ap.add_argument("--control-weights", help="control model folder (default: <control run>/final)")
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--reuse", action="append", default=[], help="NAME=report.json from `fv eval -o`")
    ap.add_argument(
        "--attempt", action="append", default=[], help="NAME=RUN_DIR of an earlier run (curves only)"
    )
    ap.add_argument("--note", action="append", default=[], help="NAME=text recorded under notes")
    ap.add_argument("--out", default=str(RESULTS / "nft_shapes.json"))
    args = ap.parse_args()

    runs = {"nft": run_log(Path(args.nft)), "control": run_log(Path(args.control))}
    for item in args.attempt:
        name, folder = item.split("=", 1)
        runs[name] = run_log(None, Path(folder).resolve())
    control_weights = args.control_weights or str(REPO / runs["control"]["output_dir"] / "final")
    models = {
        "parent": ("wan2.1-t2v-shapes", None),
        "nft": ("wan2.1-t2v-shapes-nft" if not args.nft_weights else "wan2.1-t2v-shapes", args.nft_weights),
        "control": ("wan2.1-t2v-shapes", control_weights),
    }
    reused = dict(item.split("=", 1) for item in args.reuse)
    for name in reused:  # an extra model (an intermediate checkpoint, say): its report only
        models.setdefault(
            name, ("wan2.1-t2v-shapes", json.loads(Path(reused[name]).read_text()).get("weights"))
        )
    reports = {}
    for name, (card, weights) in models.items():
        if name in reused:
            reports[name] = json.loads(Path(reused[name]).read_text())
        else:
            reports[name] = evaluate_grid(load(card, weights), args.prompts, [30], [1.0, 4.0], ["unipc"])
        reports[name] |= {"card": card, "weights": weights}
    tables = {name: table(r) for name, r in reports.items()}
    result = {
        "settings": {"prompts": args.prompts, "steps": 30, "guidance": [1.0, 4.0], "sampler": "unipc"},
        "models": {n: {"card": models[n][0], "weights": models[n][1], "table": tables[n]} for n in models},
        "targets": TARGETS,
        "nft_verdict": verdict(tables["parent"], tables["nft"]),
        "control_verdict": verdict(tables["parent"], tables["control"]),
        "training": runs,
        "notes": dict(item.split("=", 1) for item in args.note),
        "reports": reports,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    plot(runs, out.with_suffix(".png"))
    print(json.dumps({k: result[k] for k in ("nft_verdict", "control_verdict")}, indent=2))
    for name, rows in tables.items():
        for r in rows:
            print(name, r)


if __name__ == "__main__":
    main()
