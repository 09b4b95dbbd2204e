"""STA vs dense SDPA: the attention op alone, and how often compiled flex compiles as lengths change.

Two STA kernels: ``gather`` (what the registry selects on CPU: SDPA over each
distinct window's gathered key tiles) and compiled ``flex`` (the generic path,
selected on GPUs). Each row reports the speedup over dense SDPA and its fraction
of the limit ``1 / kept fraction`` (the target is >= 0.8 at 32k tokens). Flex's
compile time (first call) is reported apart from the steady-state time. The
compile sweep calls compiled flex on grids of 7 lengths (4k-32k tokens), twice,
and counts dynamo graphs: flex pads to power-of-two tile buckets, so a new length
compiles only when it opens a new bucket.
Writes OUT (default bench/results/sta_attention.json) and a PNG beside it.
Run: python bench/sta_attention.py            (fp32 CPU, 2 and 4 heads of 64)
     python bench/sta_attention.py --device cuda --dtype bfloat16 --heads 12 --head-dim 128 --out X.json
     python bench/sta_attention.py --smoke --out X.json   (tiny grids, seconds)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from fv_sta.flex import bucket_tiles
from fv_sta.kernel import StaFlex, StaGather
from fv_sta.tiles import TileLayout

RESULTS = Path(__file__).parent / "results"
TILE = (4, 8, 8)  # 256 tokens per tile
WINDOW = (3, 3, 3)  # tiles
GRIDS = {4096: (4, 32, 32), 16384: (16, 32, 32), 32768: (16, 32, 64)}
# the compile sweep: 7 lengths, 4k to 32k tokens (16 to 128 tiles: buckets 16, 32, 64, 128)
SWEEP = [(4, 32, 32), (6, 32, 32), (8, 32, 32), (12, 32, 32), (16, 32, 32), (12, 32, 64), (16, 32, 64)]
# smoke: two lengths in one 16-tile bucket (one compile), the same shapes timed
SMOKE = dict(tile=(2, 4, 4), grids={512: (8, 8, 8)}, sweep=[(5, 8, 8), (8, 8, 8)])


def timed(fn, device: str) -> float:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def layout_of(grid, tile) -> TileLayout:
    tiles = TileLayout(grid, tile, (1, 1, 1)).tiles
    return TileLayout(grid, tile, tuple(min(w, n) for w, n in zip(WINDOW, tiles, strict=True)))


def case(tokens: int, grid, heads: int, args) -> dict:
    layout = layout_of(grid, args.tile)
    dtype, device = getattr(torch, args.dtype), args.device
    q, k, v = (torch.randn(1, heads, tokens, args.head_dim, dtype=dtype, device=device) for _ in range(3))
    runs = {
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v),
        **{
            name: partial(
                kernel, q, k, v, grid=grid, tile=layout.tile, window=layout.window, block_size=args.block_size
            )
            for name, kernel in (("gather", StaGather()), ("flex", StaFlex()))
        },
    }
    first = {name: timed(run, device) for name, run in runs.items()}  # flex: compile
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.repeats):  # interleaved, so load changes hit every kernel alike
        for name, run in runs.items():
            times[name].append(timed(run, device))
    dense = times["sdpa"]
    row = {
        "tokens": tokens,
        "heads": heads,
        "grid": grid,
        "tile": layout.tile,
        "window": layout.window,
        "kept_fraction": round(layout.kept_fraction, 4),
        "speedup_limit": round(1 / layout.kept_fraction, 2),
        "sdpa_s": stats(dense),
    }
    for name in ("gather", "flex"):
        row[name] = {
            "first_call_s": round(first[name], 3),
            "sta_s": stats(times[name]),
            "speedup_min": round(min(dense) / min(times[name]), 2),
            "speedup_median": round(statistics.median(dense) / statistics.median(times[name]), 2),
            "fraction_of_limit": round(min(dense) / min(times[name]) * layout.kept_fraction, 3),
            "speedup_paired_median": round(paired(dense, times[name]), 2),
            "fraction_of_limit_paired": round(paired(dense, times[name]) * layout.kept_fraction, 3),
        }
    print(json.dumps(row), flush=True)
    return row


def paired(dense: list[float], sta: list[float]) -> float:
    """Median over repeats of dense / STA: each pair ran back to back, so it shares that moment's load."""
    return statistics.median(d / t for d, t in zip(dense, sta, strict=True))


def stats(times: list[float]) -> dict[str, float]:
    return {"min": round(min(times), 4), "median": round(statistics.median(times), 4)}


def compile_sweep(args) -> dict:
    """Compiled flex on each grid of the sweep, twice: dynamo graphs compiled after each call."""
    torch._dynamo.reset()
    base = counters["stats"]["unique_graphs"]
    calls = []
    for rep in range(2):
        for grid in args.sweep:
            layout = layout_of(grid, args.tile)
            tokens = grid[0] * grid[1] * grid[2]
            shape = (1, args.sweep_heads, tokens, args.head_dim)
            q, k, v = (
                torch.randn(shape, dtype=getattr(torch, args.dtype), device=args.device) for _ in range(3)
            )
            geometry = dict(tile=layout.tile, window=layout.window, block_size=args.block_size)
            call = partial(StaFlex(), q, k, v, grid=grid, **geometry)
            seconds = timed(call, args.device)
            calls.append(
                {
                    "pass": rep,
                    "grid": grid,
                    "tokens": tokens,
                    "tiles": layout.num_tiles,
                    "bucket_tiles": bucket_tiles(layout.num_tiles),
                    "compiles_so_far": counters["stats"]["unique_graphs"] - base,
                    "call_s": round(seconds, 3),
                }
            )
            print(json.dumps(calls[-1]), flush=True)
    return {
        "lengths": len({c["tokens"] for c in calls}),
        "calls": len(calls),
        "compiles": calls[-1]["compiles_so_far"],
        "buckets": len({c["bucket_tiles"] for c in calls}),
        "per_call": calls,
    }


def plot(rows: list[dict], sweep: dict, args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    for name, style in (("gather", "o-"), ("flex", "s:")):
        for heads in args.heads:
            sel = [r for r in rows if r["heads"] == heads]
            ax.plot(
                [r["tokens"] for r in sel],
                [r[name]["speedup_min"] for r in sel],
                style,
                label=f"STA {name}, {heads} heads",
            )
    limit = {r["tokens"]: r["speedup_limit"] for r in rows}
    ax.plot(list(limit), list(limit.values()), "k--", label="limit 1/kept")
    ax.plot(list(limit), [0.8 * x for x in limit.values()], "k:", lw=0.8, label="0.8 x limit")
    ax.axhline(1.0, color="grey", lw=0.5)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens")
    ax.set_ylabel("dense SDPA time / STA time")
    ax.set_title(f"STA {args.tile} tile, {WINDOW} window, {args.dtype} {args.device}")
    ax.legend(fontsize=7)
    calls = sweep["per_call"]
    bx.step(range(1, len(calls) + 1), [c["compiles_so_far"] for c in calls], where="post", label="compiles")
    bx.plot(
        range(1, len(calls) + 1),
        [len({d["tokens"] for d in calls[: i + 1]}) for i in range(len(calls))],
        "k:",
        label="distinct lengths seen",
    )
    bx.set_xlabel("flex call (the length sweep, run twice)")
    bx.set_ylabel("count")
    bx.set_title(f"compiled flex: {sweep['compiles']} compiles for {sweep['lengths']} lengths")
    bx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--heads", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--block-size", type=int, help="flex block (divides the tile volume); default: one tile")
    ap.add_argument("--sweep-heads", type=int, help="heads in the compile sweep; default: the first --heads")
    ap.add_argument("--smoke", action="store_true", help="tiny grids and tile: checks the script runs")
    ap.add_argument(
        "--out", type=Path, help="default bench/results/sta_attention.json; --smoke: the temp dir"
    )
    args = ap.parse_args()
    args.out = args.out or (Path(tempfile.gettempdir()) if args.smoke else RESULTS) / "sta_attention.json"
    args.tile, args.grids, args.sweep = TILE, GRIDS, SWEEP
    args.sweep_heads = args.sweep_heads or args.heads[0]  # its graphs then serve those rows too
    if args.smoke:
        args.tile, args.grids, args.sweep = SMOKE["tile"], SMOKE["grids"], SMOKE["sweep"]
        args.heads, args.head_dim, args.repeats, args.sweep_heads = [1], 8, 1, 1
    return args


def main() -> None:
    args = parse()
    torch.manual_seed(0)
    meta = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
        "threads": torch.get_num_threads(),
        "head_dim": args.head_dim,
        "block_size": args.block_size,
        "sweep_heads": args.sweep_heads,
        "dtype": args.dtype,
        "smoke": args.smoke,
        "load_avg_1m_at_start": os.getloadavg()[0],
        "note": "min and median of interleaved repeats; fraction_of_limit = speedup_min * kept_fraction; "
        "_paired: median over repeats of dense / STA timed back to back",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    sweep = compile_sweep(args)
    rows: list[dict] = []
    for tokens, grid in args.grids.items():
        for heads in args.heads:
            rows.append(case(tokens, grid, heads, args))
            rows.sort(key=lambda r: (r["heads"], r["tokens"]))
            # rewritten after each row: a timeout keeps what finished
            args.out.write_text(json.dumps({"meta": meta, "compile_sweep": sweep, "rows": rows}, indent=2))
    plot(rows, sweep, args, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
