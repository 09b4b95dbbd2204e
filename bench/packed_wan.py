"""Wan requests of different sizes and frame counts packed into one step (CPU, medium random weights).

Usage: python bench/packed_wan.py [--steps 4] [--repeats 2] [--threads 1] [--out PATH] [--smoke]

Six concurrent requests of three latent shapes (sizes and frame counts differ, so without packing no two
share a call): fv packed (packed_attention=segments: every step one sequence of all six) vs fv batched
without packing (today's path: only equal shapes batch, so each runs alone) vs diffusers' WanPipeline
called serially, interleaved repeat by repeat (min and median). Two-forward CFG. The outputs of packed
vs each alone are compared (max abs). Writes JSON and a PNG next to it.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

# a transformer whose step costs ~tens of ms per request on one thread here
MEDIUM = dict(num_attention_heads=4, attention_head_dim=32, ffn_dim=512, num_layers=4)
# (frames, height, width) of the 6 requests
SHAPES = [(9, 256, 256), (5, 192, 320), (1, 384, 384)] * 2
PROMPTS = ["a dog on the beach", "a red car in the city", "waves", "a lighthouse at dusk", "a bowl", "rain"]


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def stats(times: list[float]) -> dict[str, float]:
    return {"min_s": min(times), "median_s": statistics.median(times)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--smoke", action="store_true", help="tiny model and sizes, one repeat")
    ap.add_argument("--out", help="JSON path (default bench/results/packed_wan.json; --smoke: the temp dir)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    steps, repeats = (2, 1) if args.smoke else (args.steps, args.repeats)
    shapes = [(f, h // 4, w // 4) for f, h, w in SHAPES] if args.smoke else SHAPES
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        from fv_wan.tiny import write_tiny_checkpoint

        folder = Path(tmp) / "wan-medium"
        write_tiny_checkpoint(folder, transformer=None if args.smoke else MEDIUM)
        result = run(str(folder), shapes, steps, repeats)
    result["machine"] = {"cpu": platform.processor() or platform.machine(), "torch_threads": args.threads}
    result["request"] = {"shapes_fhw": shapes, "steps": steps, "guidance_scale": 5.0, "repeats": repeats}
    result["request"]["smoke"] = args.smoke
    result["checkpoint"] = {"transformer": "tiny" if args.smoke else MEDIUM, "weights": "random"}
    out = Path(
        args.out
        or Path(tempfile.gettempdir() if args.smoke else Path(__file__).parent / "results")
        / "packed_wan.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    plot(out.with_suffix(".png"), result)
    print(json.dumps(result, indent=2))


def run(folder: str, shapes: list[tuple[int, int, int]], steps: int, repeats: int) -> dict:
    from diffusers import WanPipeline

    import fv_core
    from fv_core.kernels_select import select_kernel
    from fv_core.plugins import load_plugins
    from fv_core.runtime import Engine

    host = load_plugins(env={"FV_PLUGINS": "fv-wan"})
    packed_model, plain_model = fv_core.load(folder, host=host), fv_core.load(folder, host=host)
    # the packed kernel from the registry, as a deploy's kernels: {packed_attention: segments} selects it on a
    # registered card (a folder loaded by path takes no deploy kernels)
    kernel = select_kernel(host.registries, "packed_attention", "segments", "cpu")
    packed_model.instance.kernels = {**(packed_model.instance.kernels or {}), "packed_attention": kernel}
    asks = [
        dict(prompt=p, num_frames=f, height=h, width=w, seed=i, num_inference_steps=steps, guidance_scale=5.0)
        for i, (p, (f, h, w)) in enumerate(zip(PROMPTS, shapes, strict=True))
    ]
    pipe = WanPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)

    def jobs(model):
        return [model.job(model.prepare(a, request_id=f"w{i}")) for i, a in enumerate(asks)]

    def diffusers_serial():
        for a in asks:
            ask = {k: v for k, v in a.items() if k != "seed"}
            pipe(generator=torch.Generator().manual_seed(a["seed"]), output_type="np", **ask)

    cases = {
        "fv_packed6": lambda: Engine().run_batched(jobs(packed_model)),
        "fv_unpacked6": lambda: Engine().run_batched(jobs(plain_model)),
        "diffusers_serial6": diffusers_serial,
    }
    packed, alone = cases["fv_packed6"](), Engine().run_serial(jobs(packed_model))  # warm-up and parity
    pairs = zip(packed, alone, strict=True)
    worst = max(float((a.outputs["frames"] - b.outputs["frames"]).abs().max()) for a, b in pairs)
    times: dict[str, list[float]] = {}
    for _ in range(repeats):
        for name, fn in cases.items():
            times.setdefault(name, []).append(timed(fn))
    s = {k: stats(v) for k, v in times.items()}
    med = {k: v["median_s"] for k, v in s.items()}
    return {
        "concurrent_6_mixed_shapes": {
            **s,
            "packed_vs_unpacked_throughput": med["fv_unpacked6"] / med["fv_packed6"],
            "packed_vs_diffusers_serial_throughput": med["diffusers_serial6"] / med["fv_packed6"],
            "max_abs_packed_vs_alone": worst,
            "note": "unpacked: fv's engine batching without a packed kernel; no two requests share a shape, "
            "so each step runs alone",
        }
    }


def plot(path: Path, r: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = r["concurrent_6_mixed_shapes"]
    keys = ["diffusers_serial6", "fv_unpacked6", "fv_packed6"]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.bar(keys, [data[k]["median_s"] for k in keys], color=["#999", "#7ab", "#3a7"])
    ax.scatter(keys, [data[k]["min_s"] for k in keys], color="k", marker="_", s=300, label="min")
    ax.set_ylabel("median seconds")
    ax.set_title("Wan, 6 requests of 3 shapes (sizes, frame counts), CPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
