"""Qwen-Image's 20B-size transformer on one GPU: packed vs padded batching of requests of mixed sizes.

Usage: python bench/gpu/qwen_packed.py [--repeats 5] [--dtype bfloat16] [--out PATH] [--smoke]

Random weights in the published config (60 blocks, 24 heads x 128, text dim 3584); one denoise forward
of 4 requests at 1024x1024 and 1328x1328 (2 each, prompts of 32-96 tokens) as one packed sequence
(every packed_attention variant installed here: segments, sdpa's block mask, compiled flex, flash-attn
varlen where it imports) vs padded batching (each request padded to the longest, padding masked) vs
the 4 forwards one by one; seconds (min, median) and peak CUDA memory. ``--smoke`` runs a tiny config
on the CPU at 64x64 and 80x80 end to end (sdpa and segments only).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

FULL = dict(
    patch_size=2,
    in_channels=64,
    out_channels=16,
    num_layers=60,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=3584,
    axes_dims_rope=(16, 56, 56),
)
TINY = {
    **FULL,
    "num_layers": 2,
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "joint_attention_dim": 32,
}
TINY["axes_dims_rope"] = (4, 6, 6)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--smoke", action="store_true", help="tiny config on the CPU")
    ap.add_argument("--out", default=str(Path(__file__).parents[1] / "results" / "qwen_packed_gpu.json"))
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    dtype = torch.float32 if args.smoke else getattr(torch, args.dtype)
    sides = (64, 80) if args.smoke else (1024, 1328)
    repeats = 1 if args.smoke else args.repeats
    result = run(TINY if args.smoke else FULL, sides, device, dtype, repeats)
    result["smoke"] = args.smoke
    out = Path(args.out if not args.smoke else "/tmp/qwen_packed_smoke.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


def run(config: dict, sides: tuple[int, int], device: str, dtype: torch.dtype, repeats: int) -> dict:
    from diffusers import QwenImageTransformer2DModel

    from fv_core import kernels_packed
    from fv_qwen_image.transformer import qwen_forward, qwen_forward_packed

    with torch.device(device):
        dit = QwenImageTransformer2DModel(**config).to(dtype).eval()
    sizes = [sides[0], sides[1], sides[0], sides[1]]
    grids = [(1, s // 16, s // 16) for s in sizes]
    image_lens, text_lens = [g[1] * g[2] for g in grids], [32, 96, 64, 48]
    gen = torch.Generator(device).manual_seed(0)
    latents = torch.randn(
        1, sum(image_lens), config["in_channels"], generator=gen, device=device, dtype=dtype
    )
    text = torch.randn(
        1, sum(text_lens), config["joint_attention_dim"], generator=gen, device=device, dtype=dtype
    )
    t = torch.tensor([0.9, 0.7, 0.5, 0.3], device=device, dtype=dtype)
    variants = ["segments", "sdpa", "padded"]
    if device == "cuda":
        variants.append("flex")
        if kernels_packed.flash_attn_installed():
            variants.append("varlen")

    def packed(variant: str):
        kernel = getattr(kernels_packed, f"packed_{variant}")
        return lambda: qwen_forward_packed(dit, latents, t, text, grids, image_lens, text_lens, kernel)

    def serial():
        lat, txt = latents.split(image_lens, 1), text.split(text_lens, 1)
        return [qwen_forward(dit, lat[i], t[i : i + 1], txt[i], grids[i]) for i in range(4)]

    cases = {f"packed_{v}": packed(v) for v in variants if v != "padded"} | {"padded": packed("padded")}
    cases["serial"] = serial
    out: dict = {"sizes": sizes, "text_tokens": text_lens, "image_tokens": image_lens, "dtype": str(dtype)}
    reference = torch.cat(serial(), 1)
    with torch.inference_mode():
        for name, fn in cases.items():
            try:
                out[name] = measure(fn, device, repeats)
                if name != "serial":
                    out[name]["max_abs_vs_serial"] = float((fn() - reference).abs().max())
            except Exception as exc:  # a variant that cannot run here is reported, the others still run
                out[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    best = min(
        (k for k in out if k.startswith("packed_") and "median_s" in out[k]), key=lambda k: out[k]["median_s"]
    )
    if "median_s" in out.get("padded", {}):
        out["best_packed"] = best
        out["packed_vs_padded_throughput"] = out["padded"]["median_s"] / out[best]["median_s"]
        out["packed_vs_padded_peak_memory"] = out[best]["peak_bytes"] / max(out["padded"]["peak_bytes"], 1)
    return out


def measure(fn, device: str, repeats: int) -> dict:
    fn()  # warm-up (and flex's compile)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else 0
    return {"min_s": min(times), "median_s": statistics.median(times), "peak_bytes": peak}


if __name__ == "__main__":
    main()
