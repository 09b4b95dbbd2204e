"""A Wan 1.3B-size random-weight model at 480p x 81 frames, bf16: fv vs diffusers, fv with STA, fv with
FBCache, and FastWan's 3-step fixed-timestep loop eager and under ``torch.compile``.

The checkpoint is written once by ``fv_wan.tiny.write_tiny_checkpoint`` in the published diffusers layout:
the transformer at Wan2.1 1.3B's size (12 heads x 128, ffn 8960, 30 blocks), the text encoder (UMT5) and
VAE at fv's TINY sizes (text encoding and decoding are cheap here; the transformer is what is measured).
Weights are random: this measures speed, not quality.

fv cards run at their ``PrecisionContract.default`` (float32 for the Wan cards), so this script registers
two bf16 cards through a plugin of its own: the folder's card (UniPC, CFG) and FastWan's card (3 DMD steps
at fixed timesteps, no CFG) on the same folder. Variants run one after another in one process; each gets a
short warm-up request, then the timed request; the JSON is rewritten after each variant, so a timeout keeps
what finished. A variant that fails records its error and the next one runs.

Usage: python bench/gpu/wan_480p.py --out OUT.json [--device cuda] [--steps 10] [--smoke]
``--smoke``: tiny transformer at 5 frames of 32x32 on the CPU, 2 steps, no warm-up, compile with the "eager"
backend: proves every variant runs, in seconds.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import fv_cache_dit.plugin
import fv_core
import fv_sta.plugin
import fv_wan.plugin
from fv_core.card import PrecisionContract
from fv_core.deploy.card import parse_deploy
from fv_core.extend import hookimpl
from fv_core.plugins import PluginHost
from fv_wan.cards import fastwan_1_3b
from fv_wan.folder import WanFolder
from fv_wan.tiny import write_tiny_checkpoint

PLUGIN = "fv-bench-gpu"
WAN_1_3B = dict(num_attention_heads=12, attention_head_dim=128, ffn_dim=8960, num_layers=30)
PROMPT, NEGATIVE = "a cat running in the forest", "blurry low quality"
SIZES = {  # transformer overrides, request size, STA geometry (latent grid (21, 30, 52) at 480p x 81)
    "gpu": dict(
        transformer=WAN_1_3B,
        request=dict(num_frames=81, height=480, width=832),
        sta=dict(tile=[2, 8, 8], window=[3, 3, 3], block_size=128),
        fbcache=dict(Fn_compute_blocks=8),
    ),
    "smoke": dict(
        transformer={},
        request=dict(num_frames=5, height=32, width=32),
        sta=dict(tile=[1, 2, 2], window=[1, 1, 1]),
        fbcache=dict(Fn_compute_blocks=1),  # of the tiny model's 2 blocks
    ),
}
# FBCache: cache-dit's defaults, warm-up shortened to fit the few steps run here
FBCACHE = {"residual_diff_threshold": 0.08, "max_warmup_steps": 3}


class BenchCards:
    """Registers the bf16 cards of one checkpoint folder (``fv_register_cards``)."""

    def __init__(self, folder: Path) -> None:
        bf16 = PrecisionContract(supported=["float32", "bfloat16"], default="bfloat16")
        base = WanFolder.card(folder)
        self.cards = {
            "bench-wan-bf16": base.model_copy(update={"model_id": "bench-wan-bf16", "precision": bf16}),
            "bench-fastwan-bf16": fastwan_1_3b().model_copy(
                update={"model_id": "bench-fastwan-bf16", "precision": bf16, "components": base.components}
            ),
        }

    @hookimpl
    def fv_register_cards(self, register: Callable[..., None]) -> None:
        for model_id, card in self.cards.items():
            register(model_id, card)


def make_host(folder: Path) -> PluginHost:
    host = PluginHost(env={})
    for module, name in (
        (fv_wan.plugin, "fv-wan"),
        (fv_sta.plugin, "fv-sta"),
        (fv_cache_dit.plugin, "fv-cache-dit"),
    ):
        host.add(module, name)
    host.add(BenchCards(folder), PLUGIN)
    return host.collect()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], device: str) -> tuple[float, Any]:
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - start, out


def fv_variant(host, folder, args, card, *, kernels=None, interceptors=(), options=None, compile_=False):
    """Load ``card`` through a deploy (kernels, interceptors, plugin options), warm up, time one request."""
    deploy = parse_deploy(
        {
            "plugins": ["fv-wan", "fv-sta", "fv-cache-dit", PLUGIN],
            "models": [
                {
                    "card": card,
                    "weights": str(folder),
                    "kernels": kernels or {},
                    "interceptors": list(interceptors),
                }
            ],
            "plugin_options": options or {},
        }
    )
    model = fv_core.load(card, deploy=deploy, host=host, device=args.device)
    transformer = model.instance.component("transformer")
    if compile_:  # fv drives blocks itself: compile what each block calls (self-attention, feed-forward)
        for block in transformer.blocks:
            block.attn1.compile(backend=args.compile_backend)
            block.ffn.compile(backend=args.compile_backend)
    fastwan = card == "bench-fastwan-bf16"
    params = dict(prompt=PROMPT, seed=0, **args.size["request"])
    if not fastwan:
        params.update(negative_prompt=NEGATIVE, guidance_scale=5.0)
    warm_steps = {} if fastwan else {"num_inference_steps": 2}
    first_s, _ = (
        timed(lambda: model.generate(**params, **warm_steps), args.device) if args.warmup else (0.0, None)
    )
    steps = {} if fastwan else {"num_inference_steps": args.steps}
    seconds, video = timed(lambda: model.generate(**params, **steps), args.device)
    prov = video.provenance
    return {
        "seconds": round(seconds, 3),
        "warmup_s": round(first_s, 3),
        "steps": 3 if fastwan else args.steps,
        "dtype": str(model.instance.dtype),
        "kernel": prov.get("kernels", {}).get("attention"),
        "cache_dit": prov.get("metrics", {}).get("cache_dit"),
        "frames_shape": list(video.frames.shape),
    }


def diffusers_variant(folder: Path, args) -> dict:
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(str(folder), torch_dtype=torch.bfloat16).to(args.device)
    pipe.set_progress_bar_config(disable=True)

    def run(steps: int):
        generator = torch.Generator(args.device).manual_seed(0)
        return pipe(
            PROMPT,
            negative_prompt=NEGATIVE,
            num_inference_steps=steps,
            guidance_scale=5.0,
            generator=generator,
            output_type="np",
            **args.size["request"],
        )

    with torch.no_grad():
        first_s, _ = timed(lambda: run(2), args.device) if args.warmup else (0.0, None)
        seconds, out = timed(lambda: run(args.steps), args.device)
    return {
        "seconds": round(seconds, 3),
        "warmup_s": round(first_s, 3),
        "steps": args.steps,
        "dtype": str(pipe.transformer.dtype),
        "frames_shape": list(out.frames.shape),
    }


def variants(host, folder, args) -> dict[str, Callable[[], dict]]:
    sta = {"fv-sta": {"windows": [{"card": "bench-wan-bf16", **args.size["sta"]}]}}
    return {
        "diffusers": lambda: diffusers_variant(folder, args),
        "fv": lambda: fv_variant(host, folder, args, "bench-wan-bf16"),
        "fv_sta": lambda: fv_variant(
            host, folder, args, "bench-wan-bf16", kernels={"attention": "sta"}, options=sta
        ),
        "fv_fbcache": lambda: fv_variant(
            host,
            folder,
            args,
            "bench-wan-bf16",
            interceptors=["fbcache"],
            options={"fv-cache-dit": {**FBCACHE, **args.size["fbcache"]}},
        ),
        "fastwan_3step": lambda: fv_variant(host, folder, args, "bench-fastwan-bf16"),
        "fastwan_3step_compiled": lambda: fv_variant(host, folder, args, "bench-fastwan-bf16", compile_=True),
    }


def summary(rows: dict[str, dict]) -> dict[str, float]:
    """Speedups over diffusers and over plain fv (same step count), where both ran."""
    out = {}
    for ref in ("diffusers", "fv"):
        for name, row in rows.items():
            if name != ref and "seconds" in row and "seconds" in rows.get(ref, {}):
                out[f"{name}_vs_{ref}"] = round(rows[ref]["seconds"] / row["seconds"], 3)
    return out


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=10, help="steps of the CFG runs (FastWan: always 3)")
    ap.add_argument("--only", nargs="+", help="run only these variants")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    args.size = SIZES["smoke" if args.smoke else "gpu"]
    args.compile_backend = "eager" if args.smoke else "inductor"
    args.warmup = not args.smoke  # smoke: no warm-up request (its timings mean nothing)
    if args.smoke:
        args.steps, args.device = 2, "cpu"
    return args


def main() -> None:
    args = parse()
    result: dict[str, Any] = {
        "meta": {
            "device": torch.cuda.get_device_name()
            if args.device == "cuda"
            else platform.processor() or "cpu",
            "torch": torch.__version__,
            "smoke": args.smoke,
            "transformer": args.size["transformer"] or "fv tiny",
            "text_encoder_and_vae": "fv tiny (random weights)",
            "request": {**args.size["request"], "steps": args.steps, "guidance": 5.0},
            "sta": args.size["sta"],
            "fbcache": {**FBCACHE, **args.size["fbcache"]},
            "compile_backend": args.compile_backend,
        },
        "rows": {},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "wan-1.3b-random"
        result["meta"]["checkpoint_write_s"] = round(
            timed(lambda: write_tiny_checkpoint(folder, transformer=args.size["transformer"]), "cpu")[0], 1
        )
        host = make_host(folder)
        for name, run in variants(host, folder, args).items():
            if args.only and name not in args.only:
                continue
            try:
                row = run()
            except Exception as exc:  # one failing variant must not cost the others' numbers
                row = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]}
            if args.device == "cuda":
                row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
                torch.cuda.reset_peak_memory_stats()
            result["rows"][name] = row
            result["summary"] = summary(result["rows"])
            args.out.write_text(json.dumps(result, indent=2, default=str))
            print(
                name, json.dumps({k: v for k, v in row.items() if k != "traceback"}, default=str), flush=True
            )


if __name__ == "__main__":
    main()
