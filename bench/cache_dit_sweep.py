"""PSNR against cost of fv's FBCache and the ``cache-dit`` package's over thresholds (issue #19, goal 4).

Usage: python bench/cache_dit_sweep.py [--steps 30] [--repeats 3] [--threads 1] [--smoke]

The medium random-weight Wan of ``cache_dit_vs_package.py`` (same request, 30 UniPC steps, two-forward
CFG), FBCache (F1B0, 4 warm-up steps) at each ``residual_diff_threshold`` of ``THRESHOLDS``, each side
in its own subprocess. Per threshold and side: CPU seconds per video (min over repeats), the speedup over
its own uncached run and the PSNR of its frames against its own uncached frames. The PNG draws PSNR
against CPU seconds per video: a curve up and to the left is better. ``--smoke`` runs the tiny sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from cache_dit_vs_package import MEDIUM, side_fv, side_package  # noqa: E402

THRESHOLDS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.8)
SMOKE = dict(num_attention_heads=2, attention_head_dim=16, ffn_dim=64, num_layers=2)


def settings(thresholds: tuple[float, ...]) -> dict[str, dict]:
    return {
        f"R{r:g}": dict(
            Fn_compute_blocks=1, Bn_compute_blocks=0, residual_diff_threshold=r, max_warmup_steps=4
        )
        for r in thresholds
    }


def curve(side: dict, names: list[str]) -> list[dict]:
    """Per threshold: CPU seconds per video, speedup over the side's uncached run, PSNR, steps cached."""
    return [
        {
            "threshold": float(name[1:]),
            "cpu_s": side[name]["cpu_min_s"],
            "speedup": side[name]["speedup"],
            "psnr_db": side[name]["psnr_db"],
            "cached_steps": {b: len(s) for b, s in side[name]["cached"].items()},
        }
        for name in names
    ]


def dominates(fv: list[dict], pkg: list[dict]) -> bool:
    """Every package point has an fv point at least as fast (CPU s) with at least its PSNR."""
    return all(any(f["cpu_s"] <= p["cpu_s"] and f["psnr_db"] >= p["psnr_db"] for f in fv) for p in pkg)


def plot(path: Path, result: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for side, style in (("fv", "o-"), ("package", "s--")):
        points = result["curves"][side]
        finite = [p for p in points if p["psnr_db"] != float("inf")]
        for ax, x in zip(axes, ("cpu_s", "speedup"), strict=True):
            ax.plot([p[x] for p in finite], [p["psnr_db"] for p in finite], style, label=side)
            for p in finite:
                ax.annotate(f"{p['threshold']:g}", (p[x], p["psnr_db"]), fontsize=7)
        axes[0].axvline(result["uncached"][side]["cpu_min_s"], ls=":", color="C0" if side == "fv" else "C1",
                        label=f"{side} uncached")  # fmt: skip
    axes[0].set_xlabel("CPU seconds per video (min of repeats)")
    axes[1].set_xlabel("speedup over the same side's uncached run")
    for ax in axes:
        ax.set_ylabel("PSNR vs uncached (dB)")
        ax.legend(fontsize=8)
    fig.suptitle("FBCache F1B0 over residual_diff_threshold: fv vs the cache-dit package (medium Wan, CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, 4 steps, 2 thresholds")
    ap.add_argument("--out", help="JSON path (default bench/results/cache_dit_sweep.json; --smoke: temp)")
    ap.add_argument("--side", choices=["fv", "package"], help=argparse.SUPPRESS)
    ap.add_argument("--weights", help=argparse.SUPPRESS)
    args = ap.parse_args()
    thresholds = THRESHOLDS[2:4] if args.smoke else THRESHOLDS
    steps, repeats = (6, 1) if args.smoke else (args.steps, args.repeats)
    if args.side:
        import torch

        torch.set_num_threads(args.threads)
        if args.side == "fv":
            out = side_fv(args.weights, steps, repeats, settings(thresholds), concurrent=False)
        else:
            out = side_package(args.weights, steps, repeats, settings(thresholds))
        out.pop("frames_uncached")
        print(json.dumps(out))
        return

    from fv_wan.tiny import write_tiny_checkpoint

    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        weights = Path(tmp) / "wan"
        write_tiny_checkpoint(weights, transformer=SMOKE if args.smoke else MEDIUM)
        for side in ("package", "fv"):
            cmd = [
                sys.executable,
                __file__,
                "--side",
                side,
                "--weights",
                str(weights),
                "--threads",
                str(args.threads),
            ]
            cmd += ["--steps", str(args.steps), "--repeats", str(args.repeats)] + (
                ["--smoke"] if args.smoke else []
            )
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                sys.exit(f"{side} side failed:\n{done.stderr[-4000:]}")
            runs[side] = json.loads(done.stdout.strip().splitlines()[-1])
    names = list(settings(thresholds))
    curves = {side: curve(runs[side], names) for side in ("fv", "package")}
    result = {
        "checkpoint": {"transformer": SMOKE if args.smoke else MEDIUM, "weights": "random"},
        "request": {"steps": steps, "cfg": "two forwards", "sampler": "unipc", "cache": "FBCache F1B0, 4 warm-up steps"},
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "torch_threads": args.threads,
            "repeats": repeats,
            "load_avg_1m": os.getloadavg()[0],
        },
        "package": {"name": "cache-dit", "version": runs["package"]["version"]},
        "uncached": {side: runs[side]["uncached"] for side in ("fv", "package")},
        "curves": curves,
        "goal": "fv's PSNR / cost curve dominates the package's",
        "fv_dominates": dominates(curves["fv"], curves["package"]),
        "note": "cpu_s: min CPU seconds of one video over repeats (one torch thread; CPU time resists the load "
        "of a shared machine); speedup: the side's uncached cpu_s over its cached cpu_s; PSNR of decoded frames "
        "(0..1) vs the same side's uncached frames (inf: identical, not drawn)",
    }  # fmt: skip
    default = Path(tempfile.gettempdir()) / "cache_dit_sweep_smoke.json" if args.smoke else None
    out = Path(args.out or default or Path(__file__).parent / "results" / "cache_dit_sweep.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    plot(out.with_suffix(".png"), result)
    print(json.dumps({"curves": curves, "fv_dominates": result["fv_dominates"]}, indent=1))


if __name__ == "__main__":
    main()
