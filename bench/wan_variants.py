"""fv vs diffusers on every Wan variant at medium size, and Wan2.2 A14B's resident memory (CPU).

Usage: python bench/wan_variants.py [--steps 4] [--repeats 3] [--threads 1] [--out PATH] [--smoke]

For each variant (Wan2.1 I2V, Wan2.2 TI2V text-only and with an image, Wan2.2 A14B T2V and I2V)
one random-weight folder with the medium transformer (8 blocks, 8 x 64 heads; both experts for
A14B) is written in the published layout; fv (``fv_core.load`` of the folder) and diffusers'
pipeline on the same folder then run the same request alternately in this one process, the same
weights, image, prompt, seed and settings (two-forward CFG, as diffusers). Latency is min and
median over repeats, after one warm-up each, every call with a new prompt (fv's text-embedding
and text K/V caches miss: cold requests); the JSON also holds the max frame difference.

Memory: fv loads an A14B expert when the first step that needs it runs. A 1-step request (timestep
999, high-noise only) leaves one expert resident, a full request both: resident bytes of each.
``--smoke`` runs tiny sizes end to end (CI-sized).
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

import numpy as np
from wan_vs_diffusers import MEDIUM, NEGATIVE, PROMPTS, SIZE  # the medium Wan bench's model and request

SMOKE = dict(num_attention_heads=2, attention_head_dim=16, ffn_dim=64, num_layers=2)
PROMPT = PROMPTS[0]
# every timed call takes the next prompt (the same sequence on both sides): fv's text caches never hit
IMAGE = (np.random.default_rng(0).random((72, 96, 3)) * 255).astype(np.uint8)

# name -> (tiny-writer variant, diffusers pipeline, fv task, image?, extra settings)
VARIANTS = {
    "wan2.1-i2v": ("i2v", "WanImageToVideoPipeline", "i2v", True, {}),
    "wan2.2-ti2v-t2v": ("ti2v", "WanPipeline", "t2v", False, {}),
    "wan2.2-ti2v-i2v": ("ti2v", "WanImageToVideoPipeline", "i2v", True, {}),
    "wan2.2-t2v-a14b": ("t2v-a14b", "WanPipeline", "t2v", False, {"guidance_scale_2": 3.0}),
    "wan2.2-i2v-a14b": ("i2v-a14b", "WanImageToVideoPipeline", "i2v", True, {"guidance_scale_2": 3.0}),
}


def timed(fn, repeats: int) -> tuple[list[float], object]:
    """Seconds of ``fn(prompt)`` for ``repeats`` new prompts after a warm-up; the warm-up's output."""
    out, times = fn(PROMPTS[0]), []
    for i in range(repeats):
        t0 = time.perf_counter()
        fn(PROMPTS[1 + i % (len(PROMPTS) - 1)])
        times.append(time.perf_counter() - t0)
    return times, out


def summary(times: list[float]) -> dict:
    return {"min_s": round(min(times), 4), "median_s": round(statistics.median(times), 4)}


def run_variant(
    folder: str, pipeline: str, task: str, image: bool, extra: dict, steps: int, repeats: int
) -> dict:
    import diffusers
    import torch
    from PIL import Image

    import fv_core

    settings = dict(
        negative_prompt=NEGATIVE,
        num_inference_steps=steps,
        guidance_scale=5.0,
        **SIZE,
        **extra,
    )
    model = fv_core.load(weights=folder)
    pipe = getattr(diffusers, pipeline).from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    pil = Image.fromarray(IMAGE)

    def ours(prompt: str):
        image_in = pil if image else None
        return model.generate(
            task=task, image=image_in, prompt=prompt, seed=1, max_sequence_length=512, **settings
        )

    def theirs(prompt: str):
        kwargs = {"image": pil} if image else {}
        generator = torch.Generator().manual_seed(1)
        return pipe(prompt=prompt, **settings, **kwargs, generator=generator, output_type="np").frames[0]

    with torch.no_grad():
        fv_times, fv_out = timed(ours, repeats)
        df_times, df_out = timed(theirs, repeats)
    fv_s, df_s = summary(fv_times), summary(df_times)
    return {
        "fv": fv_s,
        "diffusers": df_s,
        "latency_ratio_min": round(fv_s["min_s"] / df_s["min_s"], 3),
        "latency_ratio_median": round(fv_s["median_s"] / df_s["median_s"], 3),
        "max_abs_frame_diff": float(np.abs(fv_out.frames - df_out).max()),  # the warm-up request
        "experts": fv_out.provenance["metrics"].get("experts"),
    }


def a14b_memory(folder: str) -> dict:
    """Resident parameter bytes of fv's A14B instance after a high-noise-only request, then a full one."""
    import torch

    import fv_core

    model = fv_core.load(weights=folder)
    with torch.no_grad():
        model.generate(prompt=PROMPT, seed=1, num_inference_steps=1, guidance_scale=1.0, **SIZE)
        one = model.instance.resident_bytes()
        loaded_one = model.instance.loaded()
        model.generate(prompt=PROMPT, seed=1, num_inference_steps=4, guidance_scale=1.0, **SIZE)
        both = model.instance.resident_bytes()
    return {
        "one_expert": {"resident_mib": round(one / 2**20, 2), "components": loaded_one},
        "both_experts": {"resident_mib": round(both / 2**20, 2), "components": model.instance.loaded()},
        "ratio": round(both / one, 3),
        "note": "resident_bytes: parameters and buffers of the loaded components (text encoder, VAE, experts)",
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat (CI)")
    ap.add_argument(
        "--out", help="default: bench/results/wan_variants.json (wan_variants_smoke.json with --smoke)"
    )
    args = ap.parse_args()
    name = "wan_variants_smoke.json" if args.smoke else "wan_variants.json"
    args.out = args.out or str(Path(__file__).parent / "results" / name)

    import torch

    from fv_wan.tiny import write_tiny_checkpoint

    torch.set_num_threads(args.threads)
    shape, repeats = (SMOKE, 1) if args.smoke else (MEDIUM, args.repeats)
    results, memory = {}, None
    with tempfile.TemporaryDirectory() as tmp:
        for name, (variant, pipeline, task, image, extra) in VARIANTS.items():
            folder = Path(tmp) / variant
            if not folder.exists():
                width = shape["num_attention_heads"] * shape["attention_head_dim"]
                config = {**shape, "added_kv_proj_dim": width} if variant == "i2v" else shape
                write_tiny_checkpoint(folder, transformer=config, variant=variant)
            results[name] = run_variant(str(folder), pipeline, task, image, extra, args.steps, repeats)
            print(name, json.dumps(results[name]), flush=True)
            if variant == "t2v-a14b":
                memory = a14b_memory(str(folder))
    out = {
        "checkpoint": {"transformer": shape, "weights": "random", "smoke": args.smoke},
        "request": {
            **SIZE,
            "steps": args.steps,
            "guidance": 5.0,
            "cfg": "two_forward",
            "sampler": "unipc",
            "text_caches": "cold (a new prompt every call)",
        },
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "torch_threads": args.threads,
            "repeats": repeats,
            "load_avg_1m": os.getloadavg()[0],
        },
        "variants": results,
        "a14b_memory": memory,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
