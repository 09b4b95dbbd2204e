"""The tiny shapes model: training throughput and wall time, and C4 accuracy of the shipped weights.

Reads the summaries ``fv train`` wrote for the committed configs (configs/shapes/*.yaml: the VAE,
the transformer + UMT5, and the frozen-UMT5 comparison run), compares
joint vs frozen text encoder, then evaluates the shipped card (``fv eval``'s grid: steps x guidance, 128 fixed prompts each) and writes
bench/results/train_shapes.json, bench/results/train_shapes_{loss,accuracy}.png and
docs/shapes-strip.png.

    python bench/train_shapes.py                       # after training with the committed configs
    python bench/train_shapes.py --prompts 16 --steps 4  # a quick look
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors import safe_open

from fv_core.training import load_config
from fv_train_flow.eval import evaluate_folder, evaluate_grid, load

REPO = Path(__file__).resolve().parents[1]
CONFIGS = {
    "vae": REPO / "configs/shapes/vae.yaml",
    "flow": REPO / "configs/shapes/flow.yaml",
    "flow_frozen_text": REPO / "configs/shapes/flow_frozen_text.yaml",
}
SHIPPED_FLOW = ("vae", "flow")  # the runs the shipped weights come from
RESULTS = REPO / "bench/results"


def training_summary() -> dict:
    """Per config: steps, batch, wall seconds and samples/s from the run's summary.json and log, and
    the latent pool's encode time; the shipped model's total counts the VAE and the joint flow run."""
    out = {}
    for name, path in CONFIGS.items():
        cfg = load_config(path)
        run = REPO / cfg.output_dir
        summary = json.loads((run / "summary.json").read_text())
        log = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
        evals = [r for r in log if "eval" in r]
        out[name] = {
            "config": str(path.relative_to(REPO)),
            **summary,
            "last_eval": evals[-1] if evals else None,
        }
        pool = run / "latent_pool.safetensors"
        if pool.is_file():  # encoded once, possibly by an earlier run of the config: not in wall_s
            with safe_open(pool, "pt") as f:
                out[name]["latent_pool_encode_s"] = float(f.metadata()["encode_s"])
    out["shipped_wall_s"] = round(
        sum(out[n]["wall_s"] + out[n].get("latent_pool_encode_s", 0.0) for n in SHIPPED_FLOW), 1
    )
    return out


def plot_losses(png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(CONFIGS), figsize=(5 * len(CONFIGS), 3.5))
    for ax, (name, path) in zip(axes, CONFIGS.items(), strict=True):
        log = REPO / load_config(path).output_dir / "log.jsonl"
        rows = [json.loads(line) for line in log.read_text().splitlines()]
        train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
        ax.plot(*zip(*train, strict=True), label="train loss")
        evals = [r for r in rows if "eval" in r]
        key, label = (
            ("val_loss", "val loss, held-out combos") if "flow" in name else ("mse", "eval mse, all combos")
        )
        if evals:
            ax.plot(*zip(*[(r["step"], r["eval"][key]) for r in evals], strict=True), "o-", label=label)
        ax.set_title(str(path.relative_to(REPO)), fontsize=9)
        ax.set_xlabel("step")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def plot_accuracy(results: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [
        f"{r['settings']['sampler']} {r['settings']['steps']}st g{r['settings']['guidance']:g}"
        for r in results
    ]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
    for ax, group in zip(axes, ("seen", "held_out"), strict=True):
        width = 0.2
        for i, attr in enumerate(("colour", "shape", "direction", "joint")):
            xs = [j + (i - 1.5) * width for j in range(len(results))]
            ax.bar(xs, [r[group][attr] for r in results], width, label=attr)
        ax.set_xticks(range(len(results)), labels, rotation=30, ha="right", fontsize=8)
        ax.set_title(f"{group} combinations (n={results[0][group]['n']})")
        ax.set_ylim(0, 1.05)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("detector accuracy")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def single_video_seconds(model, repeats: int = 3) -> dict[str, float]:
    """Latency of one unbatched `fv generate` call at the card's defaults (median of ``repeats``)."""
    times = {}
    for steps, guidance in ((4, 1.0), (30, 4.0)):
        params = {
            "prompt": "a green square moving up",
            "num_inference_steps": steps,
            "guidance_scale": guidance,
        }
        model.generate(**params)  # warm-up
        runs = sorted(model.generate(**params, seed=i).provenance["seconds"] for i in range(repeats))
        times[f"steps{steps}_guidance{guidance:g}"] = runs[repeats // 2]
    return times


def text_encoder_comparison(card: str, prompts: int) -> dict:
    """Joint vs frozen UMT5: each flow run's final checkpoint (same VAE) at 30 UniPC steps, guidance 1
    (the card's default) and 4."""
    rows = {}
    for name in ("flow", "flow_frozen_text"):
        cfg = load_config(CONFIGS[name])
        for guidance in (1.0, 4.0):
            report = evaluate_folder(
                REPO / cfg.output_dir / "final", prompts, 30, guidance, card=card,
                max_sequence_length=cfg.options.get("max_sequence_length"),
            )  # fmt: skip
            row = {"train_text_encoder": cfg.options["train_text_encoder"], "guidance": guidance}
            rows[f"{name}_guidance{guidance:g}"] = {**row, **report["all"]}
            print(name, guidance, json.dumps(report["all"]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="wan2.1-t2v-shapes")
    parser.add_argument("--weights", help="default: the card's embedded weights")
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--steps", default="4,8,30")
    parser.add_argument("--guidance", default="4,1")  # last: the card's default, shown in the strip
    parser.add_argument("--samplers", default="euler,unipc")  # the strip shows the last cell's videos
    args = parser.parse_args()
    torch.set_num_threads(1)
    RESULTS.mkdir(exist_ok=True)
    (REPO / "docs").mkdir(exist_ok=True)
    training = training_summary()
    plot_losses(RESULTS / "train_shapes_loss.png")
    model = load(args.model, args.weights)
    grid = evaluate_grid(
        model,
        args.prompts,
        [int(s) for s in args.steps.split(",")],
        [float(g) for g in args.guidance.split(",")],
        args.samplers.split(","),
        strip=REPO / "docs/shapes-strip.png",
    )
    plot_accuracy(grid["results"], RESULTS / "train_shapes_accuracy.png")
    text_encoder = text_encoder_comparison(args.model, args.prompts)
    single = single_video_seconds(model)
    table = [
        {**r["settings"], **{f"{g}_{a}": r[g][a] for g in ("all", "seen", "held_out")
                             for a in ("colour", "shape", "direction", "joint")},
         "start_spread": r["all"]["start_spread"], "real_start_spread": r["real_start_spread"],
         "square_fill_median": r["all"]["square_fill_median"], "circle_fill_median": r["all"]["circle_fill_median"],
         "seconds_per_video": r["seconds_per_video"]}
        for r in grid["results"]
    ]  # fmt: skip
    report = {"model": args.model, "weights": model.weights, "torch_threads": 1, "training": training,
              "single_video_seconds": single, "accuracy_table": table,
              "text_encoder_comparison": text_encoder, **grid}  # fmt: skip
    (RESULTS / "train_shapes.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(table, indent=2))


if __name__ == "__main__":
    main()
