"""Parallel groups against one process: time per denoise step, communication volume, output difference.

Usage: python bench/parallel.py [--device cpu|cuda] [--plans sp=2,cfg=2 ...] [--repeats 5]
                                [--out PATH] [--smoke]

A random-weight Wan folder in the published layout (the medium bench's transformer: 8 blocks,
8 x 64 heads; ``--size gpu``: a Wan 1.3B-size one) is loaded once alone and once per plan with
``fv_core.load(..., parallel=plan)``. For each video size the loop is driven to its first denoise step
and that step's body (what the scheduler calls: for a group, broadcast, every rank's forward with its
all-to-alls, gather) is timed ``--repeats`` times after a warm-up: min and median. Communication is
every byte the group moved for one step, by kind (the step broadcast, Ulysses all-to-all, the
sequence all-gather, the replies). The difference is the max |latents| and |frames| difference of a
whole request (4 steps, two-forward CFG) against the one-process run on the same weights and seed.

On CPU a group's ranks share the machine's cores (each gets cores / world threads), so a parallel
step is not faster here; the numbers show the communication a plan adds. ``bench/gpu/parallel.sh``
runs the same on GPUs. ``--smoke`` runs tiny sizes end to end (CI-sized).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

MEDIUM = dict(num_attention_heads=8, attention_head_dim=64, ffn_dim=2048, num_layers=8)
WAN_1_3B = dict(num_attention_heads=12, attention_head_dim=128, ffn_dim=8960, num_layers=30)
SMOKE = dict(num_attention_heads=2, attention_head_dim=16, ffn_dim=64, num_layers=2)
SIZES = {  # (frames, height, width) per model size
    "medium": [(9, 64, 64), (17, 128, 128), (17, 192, 192)],
    "gpu": [(81, 480, 832), (33, 480, 832), (17, 480, 832)],
    "smoke": [(5, 32, 48)],
}
REQUEST = dict(prompt="a red car in the city at night", negative_prompt="blurry", guidance_scale=5.0, seed=0)


def drive_to_denoise(model, params: dict):
    """The first denoise step's plan of a request: every phase before it run inline."""
    from fv_core.loop import StepResult

    request = model.prepare(params)
    loop = model.loop(model.card.programs[request.task].stages[0])
    state = loop.init(request, model.instance, None)
    while state.values["phase"] != "denoise":
        plan = loop.next(state)
        loop.advance(state, StepResult(plan.body(plan.inputs)))
    return loop.next(state)


def time_step(model, params: dict, repeats: int) -> dict:
    """Min / median seconds of one denoise step's body, and the bytes a group moved for one."""
    from fv_core.parallel import TRAFFIC

    plan = drive_to_denoise(model, params)
    plan.body(plan.inputs)  # warm-up
    group = model.parallel
    sent, workers, kinds = TRAFFIC.total(), group.worker_bytes if group else 0, dict(TRAFFIC.bytes)
    times = []
    for _ in range(repeats):
        sync(model)
        t0 = time.perf_counter()
        plan.body(plan.inputs)
        sync(model)
        times.append(time.perf_counter() - t0)
    per_step = {k: (v - kinds.get(k, 0)) // repeats for k, v in TRAFFIC.bytes.items() if v != kinds.get(k, 0)}
    worker_bytes = ((group.worker_bytes if group else 0) - workers) // repeats
    return {
        "step_min_s": round(min(times), 5),
        "step_median_s": round(statistics.median(times), 5),
        "comm_bytes_per_step": (TRAFFIC.total() - sent) // repeats + worker_bytes,
        "rank0_comm_by_kind": per_step,
        "workers_comm_bytes": worker_bytes,
    }


def sync(model) -> None:
    if model.instance.device.type == "cuda":
        torch.cuda.synchronize()


def whole_request(model, params: dict) -> dict:
    from fv_core.runtime import Engine

    return Engine().run_one(*model.job(model.prepare({**params, "num_inference_steps": 4}))).outputs


def measure(weights: str, plans: list[str], sizes: list, repeats: int, device: str) -> dict:
    from fv_core.load import load

    threads = torch.get_num_threads()
    results: dict = {"single": {}}
    single = load(weights, device=device)
    reference = {}
    for frames, height, width in sizes:
        params = {**REQUEST, "num_frames": frames, "height": height, "width": width}
        key = f"{frames}x{height}x{width}"
        results["single"][key] = {**time_step(single, params, repeats), "tokens": tokens(single, params)}
        reference[key] = whole_request(single, params)
    for plan in plans:
        model = load(weights, device=device, parallel=plan)
        results[plan] = {}
        try:
            for frames, height, width in sizes:
                params = {**REQUEST, "num_frames": frames, "height": height, "width": width}
                key = f"{frames}x{height}x{width}"
                row = time_step(model, params, repeats)
                out, ref = whole_request(model, params), reference[key]
                row["max_diff"] = {n: float((out[n] - ref[n]).abs().max()) for n in ("latents", "frames")}
                row["step_ratio_vs_single"] = round(
                    row["step_median_s"] / results["single"][key]["step_median_s"], 3
                )
                row["tokens"] = results["single"][key]["tokens"]
                results[plan][key] = row
        finally:
            model.close()
            torch.set_num_threads(threads)
    return results


def tokens(model, params: dict) -> int:
    v = model.instance.variant
    frames = (params["num_frames"] - 1) // v.temporal_scale + 1
    return frames * (params["height"] // v.spatial_scale // 2) * (params["width"] // v.spatial_scale // 2)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for plan, rows in results.items():
        xs = [r["tokens"] for r in rows.values()]
        left.plot(xs, [r["step_median_s"] * 1e3 for r in rows.values()], "o-", label=plan)
        if plan != "single":
            right.plot(xs, [r["comm_bytes_per_step"] / 2**20 for r in rows.values()], "o-", label=plan)
    left.set(xlabel="latent tokens", ylabel="ms per denoise step (median)", title="step time")
    right.set(xlabel="latent tokens", ylabel="MiB moved per step", title="communication")
    for ax in (left, right):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--plans", nargs="+", default=["sp=2", "cfg=2", "sp=2,cfg=2"])
    parser.add_argument("--size", choices=["medium", "gpu"], default="medium")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat (CI)")
    args = parser.parse_args()
    size = "smoke" if args.smoke else args.size
    transformer = {"smoke": SMOKE, "medium": MEDIUM, "gpu": WAN_1_3B}[size]
    repeats = 1 if args.smoke else args.repeats
    default_out = f"bench/results/parallel{'_smoke' if args.smoke else ''}{'_' + args.device if args.device != 'cpu' else ''}.json"
    out = Path(args.out or default_out)

    from fv_wan.tiny import write_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        weights = str(Path(tmp) / "wan")
        write_tiny_checkpoint(weights, transformer=transformer)
        results = measure(weights, args.plans, SIZES[size], repeats, args.device)
    report = {
        "bench": "parallel",
        "device": args.device,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "transformer": transformer,
        "repeats": repeats,
        "results": results,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    plot(results, out.with_suffix(".png"))
    print(json.dumps(report["results"], indent=1))


if __name__ == "__main__":
    main()
