"""#16's NFT targets at the published scale, as one device call: configs/shapes/nft_published.yaml trained on
``--device`` in segments of ``--segment`` steps until ``--minutes`` run out; the parent and each segment's
student are judged as fv eval judges them (384 prompts, 30 UniPC steps, guidance 1 and 4) and the JSON is
rewritten after each, so a timeout keeps every finished segment. Re-running with the same ``--run-dir``
resumes the training from its newest checkpoint.

    python bench/gpu/nft_published.py --device cuda --minutes 8 --out OUT/nft_published.json

``--smoke``: the same code on the CPU at toy sizes (2 groups of 2, 1 step, 8 prompts at 2 steps).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from fv_core.plugins import load_plugins
from fv_core.training import load_config, train
from fv_train_flow.eval import evaluate_model, load

CONFIG = Path(__file__).resolve().parents[2] / "configs/shapes/nft_published.yaml"
SMOKE = {"prompts_per_step": 2, "group_size": 2, "rollout_steps": 2, "lora_rank": 2, "lora_alpha": 4}


def judge(card: str, weights: Path | None, device: str, prompts: int, steps: int) -> dict:
    """fv eval's rows (all, held_out, seen, by_caption) at guidance 1 and 4, and the seconds they took."""
    model = load(card, weights, device)
    try:
        start = time.perf_counter()
        rows = {f"g{g:g}": evaluate_model(model, prompts, steps, g) for g in (1.0, 4.0)}
        return {**rows, "eval_s": round(time.perf_counter() - start, 1)}
    finally:
        model.close()


def targets(parent: dict, student: dict) -> dict:
    """#16's NFT targets read off one judged student (parent: the same judge's reading of the card)."""
    g1, g4, p1 = student["g1"]["all"], student["g4"]["all"], parent["g1"]["all"]
    return {
        "held_out_shape_g1>=0.95": student["g1"]["held_out"]["shape"] >= 0.95,
        "shape_g4>=0.90": g4["shape"] >= 0.90,
        "spread>=0.8x": g1["start_spread"] >= 0.8 * p1["start_spread"],
        "colour_kept": g1["colour"] >= p1["colour"] - 0.02,
        "direction_kept": g1["direction"] >= p1["direction"] - 0.02,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--minutes", type=float, default=8.0, help="stop starting segments after this")
    ap.add_argument("--segment", type=int, default=10, help="training steps between judgements")
    ap.add_argument("--run-dir", default="fv-data/nft-published", help="checkpoints (resumed if present)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    start = time.perf_counter()
    overrides = {"device": "cpu" if args.smoke else args.device, "output_dir": args.run_dir}
    cfg = load_config(CONFIG, overrides)
    if args.smoke:
        cfg = cfg.model_copy(update={"steps": 1, "batch_size": 4, "options": {**cfg.options, **SMOKE}})
    prompts, steps = (8, 2) if args.smoke else (384, 30)
    card = cfg.options["card"]
    report: dict = {"config": str(CONFIG.name), "device": cfg.device, "smoke": args.smoke, "segments": []}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report["parent"] = judge(card, None, cfg.device, prompts, steps)
    out.write_text(json.dumps(report, indent=1))
    method = load_plugins().registries.methods.get(cfg.method)(cfg)
    done = max((int(p.name.split("-")[1]) for p in Path(cfg.output_dir).glob("checkpoint-*")), default=0)
    while done < cfg.steps and time.perf_counter() - start < args.minutes * 60:
        done = min(done + args.segment, cfg.steps)
        summary = train(cfg.model_copy(update={"steps": done}), method, progress=False)
        student = judge(card, Path(cfg.output_dir) / "final", cfg.device, prompts, steps)
        row = {"step": done, "train_wall_s": summary["wall_s"], "last": summary["last"], **student}
        report["segments"].append({**row, "targets": targets(report["parent"], student)})
        report["elapsed_s"] = round(time.perf_counter() - start, 1)
        out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
