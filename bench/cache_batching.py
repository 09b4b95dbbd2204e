"""Caching composes with batching: 4 concurrent FBCache requests on one medium random-weight Wan (CPU).

Usage: python bench/cache_batching.py [--steps 20] [--repeats 2] [--threads 1] [--out PATH]

One process, one torch thread; round by round (the machine is shared and
noisy) it times: one request uncached and FBCache-cached (``run_one``); 4
requests uncached and cached, batched step by step (``run_batched``: the
cached requests' first block runs for all 4 rows, the middle span for the
rows that compute, as one call); and the 4 cached requests interleaved
unbatched (what a cached request got before: its plan left every batch).
The JSON holds min/median wall and min CPU times, the solo cached speedup
S, the 4-concurrent cached throughput relative to one uncached request and
its ratio to the goal 4 x S, how the batched cached frames compare with each
request's solo cached run (max abs, same decisions), and a PNG of the
throughputs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from cache_dit_vs_package import FAMILIES, GUIDANCE, MEDIUM, SIZE, fv_job, psnr, rounds, summary  # noqa: E402

FBCACHE = dict(residual_diff_threshold=0.2, max_warmup_steps=4)  # random weights need > the 0.08 default
CONCURRENT = 4


class Sizes:
    """Observer: ``batched_with`` of every denoise step."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def on_start(self, state, request) -> None: ...

    def on_finish(self, state, result) -> None: ...

    def on_step(self, state, plan, result) -> None:
        if plan.label.startswith("denoise"):
            self.sizes.append(result.batched_with)


def measure(weights: str, steps: int, repeats: int) -> dict:
    import torch

    import fv_core
    from fv_cache_dit import FBCache
    from fv_core.parity import compare_results
    from fv_core.runtime import Engine

    model = fv_core.load(weights)

    def req(i: int):
        return fv_job(model, FAMILIES["wan"], i, steps)

    def engine(cached: bool, observers=()) -> Engine:
        return Engine(interceptors=[FBCache(**FBCACHE)] if cached else [], observers=list(observers))

    def four(cached: bool, mode: str, observers=()):
        return getattr(engine(cached, observers), mode)([req(i) for i in range(CONCURRENT)])

    runs = {
        "serial4_uncached": lambda: four(False, "run_serial"),
        "serial4_cached": lambda: four(True, "run_serial"),
        "batched4_uncached": lambda: four(False, "run_batched"),
        "batched4_cached": lambda: four(True, "run_batched"),
        "interleaved4_cached_unbatched": lambda: four(True, "run_interleaved"),
    }
    with torch.no_grad():
        four(False, "run_batched")  # warm-up: loads components, fills the text caches of every prompt
        outs, times = rounds(runs, repeats)
        sizes = Sizes()
        batched = four(True, "run_batched", [sizes])
    serial = outs["serial4_cached"]
    report = compare_results(serial, batched, "batched", tolerance=1e-4)
    stats = [r.metrics["cache_dit"] for r in batched]
    return {
        "times": {name: summary(t) for name, t in times.items()},
        "batched_with_per_denoise_step": sorted(set(sizes.sizes)),
        "batched_cached_vs_solo_cached": {
            "max_abs_frames": report.max_abs,
            "same_decisions": stats == [r.metrics["cache_dit"] for r in serial],
            "cached_steps_per_request": [s["cached"] for s in stats],
            "computed_steps_per_request": [s["computed"] for s in stats],
        },
        "psnr_solo_cached_vs_uncached_db": [
            psnr(c.outputs["frames"], u.outputs["frames"])
            for c, u in zip(serial, outs["serial4_uncached"], strict=True)
        ],
    }


def derive(m: dict) -> dict:
    t = {name: v["cpu_min_s"] for name, v in m["times"].items()}
    w = {name: v["min_s"] for name, v in m["times"].items()}
    out = {}
    for clock, c in (("cpu", t), ("wall", w)):
        s = c["serial4_uncached"] / c["serial4_cached"]  # solo cached speedup of the 4 requests
        b = c["serial4_uncached"] / c["batched4_uncached"]  # batching gain, uncached
        g = c["serial4_uncached"] / c["batched4_cached"]  # both: vs the 4 run uncached one by one
        out[clock] = {
            "solo_cached_speedup": s,
            "batching_gain_uncached": b,
            "batching_gain_cached": c["serial4_cached"] / c["batched4_cached"],
            "batched4_cached_throughput_vs_one_uncached": g,
            "composition": g / (b * s),
            "goal_4x_solo_cached_speedup": CONCURRENT * s,
            "ratio_to_goal": g / (CONCURRENT * s),
            "unbatched_interleaved4_cached_throughput_vs_one_uncached": c["serial4_uncached"]
            / c["interleaved4_cached_unbatched"],
        }
    return out


def plot(path: Path, d: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = d["cpu"]
    bars = {
        "1 uncached": 1.0,
        "1 FBCache": c["solo_cached_speedup"],
        "4 uncached\nbatched": c["batching_gain_uncached"],
        "4 FBCache\ninterleaved\n(unbatched)": c["unbatched_interleaved4_cached_throughput_vs_one_uncached"],
        "4 FBCache\nbatched": c["batched4_cached_throughput_vs_one_uncached"],
    }
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(list(bars), list(bars.values()), color=["#999", "#6a6", "#999", "#c96", "#393"])
    multiplied = c["batching_gain_uncached"] * c["solo_cached_speedup"]
    ax.axhline(multiplied, color="b", ls="--", label="batching gain x solo FBCache speedup")
    ax.axhline(0.9 * multiplied, color="b", ls=":", label="0.9 x that")
    ax.set_ylabel("throughput vs one uncached request (CPU time)")
    ax.set_title("FBCache with step batching, medium Wan, 1 CPU thread")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "cache_batching.json"))
    args = ap.parse_args()
    import torch

    from fv_wan.tiny import write_tiny_checkpoint

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        weights = Path(tmp) / "wan-medium"
        write_tiny_checkpoint(weights, transformer=MEDIUM)
        m = measure(str(weights), args.steps, args.repeats)
    d = derive(m)
    result = {
        "checkpoint": {"transformer": MEDIUM, "weights": "random"},
        "request": {**SIZE, "steps": args.steps, "guidance": GUIDANCE, "cfg": "two forwards"},
        "fbcache": FBCACHE,
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "torch_threads": args.threads,
            "repeats": args.repeats,
            "load_avg_1m": os.getloadavg()[0],
        },
        **m,
        "derived": d,
        "goal": "4 concurrent FBCache requests reach >= 0.9 x (4 x their solo cached speedup)",
        "goal_met_literal_cpu": d["cpu"]["ratio_to_goal"] >= 0.9,
        "composition_met_cpu": d["cpu"]["composition"] >= 0.9,
        "note": "throughputs relative to one uncached request run alone (the 4 run one by one, per request); "
        "'cpu' uses min CPU time over repeats (robust on a shared machine), 'wall' min wall time. The literal "
        "goal assumes a batch of 4 costs about one request (a GPU: batching gain 4); on one CPU thread a batch "
        "of 4 costs nearly 4 (the batching gain is ~1.1-1.3), so what CPU can measure is whether caching and "
        "batching multiply: 'composition' = gain with both / (batching gain x solo cached speedup).",
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    plot(out.with_suffix(".png"), d)
    print(json.dumps({k: result[k] for k in ("derived", "batched_cached_vs_solo_cached", "times")}, indent=1))


if __name__ == "__main__":
    main()
