"""Training methods on the shapes model: seconds per training step of each method, next to a plain
PyTorch flow-matching step on diffusers' own modules (the peer: what fv's train-profile step bodies
cost over calling the modules directly), plus the quality tables the methods' runs measured.

Per method (``flow``, ``dmd2`` at 2 and 1 steps, the 1-step one with DMD2's GAN term and with DMD's
regression, ``self_forcing`` as its shipped stage with the regression, ``nft``) the committed config under
configs/shapes/ is built as ``fv train`` builds it (``flow`` finetunes the embedded model instead of a
fresh init, so no trained VAE folder is needed; a config that continues an earlier run's student starts
from the teacher here, which costs the same) and ``step`` is timed after a warm-up; min / median of the
repeats.
The quality tables are copied from bench/results/dmd2_shapes.json and nft_shapes.json (written by
the methods' own eval runs; see the README). Writes bench/results/train_methods.{json,png}.

    python bench/train_methods.py            # the committed configs (NFT's step rolls out 48 videos)
    python bench/train_methods.py --smoke    # tiny batches, one repeat: checks the script end to end
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import fv_core
from fv_core.plugins import load_plugins
from fv_core.training import load_config

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench/results"
CONFIGS = {
    "flow": REPO / "configs/shapes/flow.yaml",
    "dmd2": REPO / "configs/shapes/dmd2_2step.yaml",
    "dmd2_1step": REPO / "configs/shapes/dmd2_1step.yaml",
    "dmd2_1step_gan": REPO / "configs/shapes/dmd2_1step_gan.yaml",
    "dmd2_1step_regression": REPO / "configs/shapes/dmd2_1step_regression.yaml",
    "self_forcing": REPO / "configs/shapes/self_forcing_stage4.yaml",
    "nft": REPO / "configs/shapes/nft.yaml",
}
QUALITY = {"dmd2": RESULTS / "dmd2_shapes.json", "nft": RESULTS / "nft_shapes.json"}
SMOKE = {  # options that shrink a step for --smoke (the others' batch size is enough)
    "nft": {"prompts_per_step": 1, "group_size": 2, "rollout_steps": 2, "train_timesteps": 1},
}


def build(name: str, out: Path, smoke: bool) -> Any:
    """The method of ``name``'s committed config, writing under ``out``."""
    cfg = load_config(CONFIGS[name], {"output_dir": str(out / name)})
    options = dict(cfg.options)
    if name == "flow":  # finetune the embedded weights: no trained VAE folder needed
        options = {**options, "vae": None, "init_weights": fv_core.load("wan2.1-t2v-shapes").weights}
    options.pop("student_weights", None)  # an earlier run's student: the teacher's weights cost the same
    if smoke:
        options.update(SMOKE.get(name, {}))
    cfg = cfg.model_copy(update={"options": options, "batch_size": 2 if smoke else cfg.batch_size})
    return cfg, load_plugins().registries.methods.get(cfg.method)(cfg)


def time_steps(step, warmup: int, repeats: int) -> list[float]:
    for i in range(warmup):
        step(i)
    times = []
    for i in range(warmup, warmup + repeats):
        start = time.perf_counter()
        step(i)
        times.append(time.perf_counter() - start)
    return times


def plain_flow_step(batch: int, max_sequence_length: int):
    """The peer: one flow-matching step written directly on diffusers' WanTransformer3DModel and
    transformers' UMT5 (fresh copies of the embedded weights, diffusers' own attention), same batch."""
    from diffusers import WanTransformer3DModel
    from transformers import AutoTokenizer, UMT5EncoderModel

    root = Path(fv_core.load("wan2.1-t2v-shapes").weights)
    transformer = WanTransformer3DModel.from_pretrained(root / "transformer").train()
    text_encoder = UMT5EncoderModel.from_pretrained(root / "text_encoder").train()
    tokenizer = AutoTokenizer.from_pretrained(root / "tokenizer")
    params = [*transformer.parameters(), *text_encoder.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-4)
    prompts = ["a red circle moving left"] * batch
    gen = torch.Generator().manual_seed(0)

    def step(i: int) -> None:
        enc = tokenizer(prompts, padding="max_length", max_length=max_sequence_length, return_tensors="pt")
        hidden = text_encoder(enc.input_ids, enc.attention_mask).last_hidden_state
        x0 = torch.randn(batch, 16, 3, 8, 8, generator=gen)
        noise = torch.randn(x0.shape, generator=gen)
        sigma = torch.rand(batch, generator=gen)
        s = sigma.view(-1, 1, 1, 1, 1)
        pred = transformer((1 - s) * x0 + s * noise, sigma * 1000, hidden, return_dict=False)[0]
        loss = torch.nn.functional.mse_loss(pred, noise - x0)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()

    return step


def summarise(times: list[float], batch: int) -> dict[str, float]:
    return {
        "step_s_min": round(min(times), 4),
        "step_s_median": round(statistics.median(times), 4),
        "step_s_mean": round(statistics.fmean(times), 4),  # DMD2's generator runs every few steps
        "samples_per_s_median": round(batch / statistics.median(times), 2),
        "repeats": len(times),
    }


def plot(report: dict[str, Any], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timing = report["step_time"]
    rows = report["quality_rows"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, max(4.5, 0.22 * len(rows) + 1.5)))
    names = list(timing)
    left.barh(names, [timing[n]["step_s_median"] for n in names], color="tab:blue")
    left.invert_yaxis()
    left.set_xlabel("seconds per training step (median)")
    left.set_xscale("log")
    left.set_title("step time (batch as configured)")
    if rows:
        labels = [r["label"] for r in rows]
        right.barh(labels, [r["shape"] for r in rows], color="tab:orange")
        right.invert_yaxis()
        right.tick_params(axis="y", labelsize=7)
        right.set_xlim(0, 1.0)
        right.set_xlabel("shape accuracy, held-out combinations")
        worst = min(min(r["colour"], r["direction"]) for r in rows)
        right.set_title(f"fv eval (colour and direction >= {worst:.2f} in every row)")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def quality_rows(quality: dict[str, Any]) -> list[dict[str, Any]]:
    """(label, held-out colour / shape / direction) per evaluated cell: DMD2's ``table`` rows and
    NFT's per-model tables (parent, NFT, control; guidance 1 and 4)."""
    tables = [quality["dmd2"].get("table", [])] if "dmd2" in quality else []
    tables += [  # the parent is DMD2's teacher row already at guidance 1
        [
            {"card": f"nft run: {name}", **row}
            for row in model["table"]
            if name != "parent" or row["guidance"] != 1
        ]
        for name, model in quality.get("nft", {}).get("models", {}).items()
    ]
    return [
        {
            "label": f"{row['card']} ({row['steps']} steps, g{row['guidance']:g})",
            **{axis: row[f"held_out_{axis}"] for axis in ("colour", "shape", "direction")},
        }
        for table in tables
        for row in table
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny batches, one repeat")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--output", type=Path, help="default bench/results/train_methods.json; --smoke: temp dir"
    )
    args = parser.parse_args()
    args.output = (
        args.output or (Path(tempfile.gettempdir()) if args.smoke else RESULTS) / "train_methods.json"
    )
    torch.set_num_threads(1)
    repeats = 1 if args.smoke else args.repeats
    timing: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in CONFIGS:
            cfg, method = build(name, Path(tmp), args.smoke)
            reps = max(1, repeats // 2) if name == "nft" else repeats  # an NFT step rolls out videos
            # an NFT step's samples are its rollouts (prompts x group), trained on in batches of batch_size
            opts = method.opts
            samples = opts.prompts_per_step * opts.group_size if name == "nft" else cfg.batch_size
            timing[name] = {"batch_size": cfg.batch_size, "samples_per_step": samples}
            timing[name] |= summarise(time_steps(method.step, 1, reps), samples)
            print(name, timing[name], flush=True)
    batch = timing["flow"]["batch_size"]
    peer = time_steps(plain_flow_step(batch, 16), 1, repeats)
    timing["plain_pytorch_flow"] = {"batch_size": batch, **summarise(peer, batch)}
    quality = {m: json.loads(p.read_text()) for m, p in QUALITY.items() if p.is_file()}
    report = {
        "torch_threads": 1,
        "smoke": args.smoke,
        "step_time": timing,
        "fv_flow_over_plain": round(
            timing["flow"]["step_s_median"] / timing["plain_pytorch_flow"]["step_s_median"], 3
        ),
        "quality": quality,
        "quality_rows": quality_rows(quality),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, args.output.with_suffix(".png"))
    print(json.dumps({k: report[k] for k in ("step_time", "fv_flow_over_plain")}, indent=2))


if __name__ == "__main__":
    main()
