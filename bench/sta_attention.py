"""STA vs dense SDPA: the attention op alone, fp32 on CPU.

Two STA kernels: ``gather`` (what the registry selects on CPU: SDPA over each
query tile's gathered window) and compiled ``flex`` (the generic path, selected
on GPUs). Writes bench/results/sta_attention.json and sta_attention.png (speedup
vs tokens). Flex's compile time (first call: dynamo + inductor + C++ build, or a
disk cache hit) is reported apart from the steady-state time.
Run: python bench/sta_attention.py
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from fv_sta.kernel import StaFlex, StaGather
from fv_sta.tiles import TileLayout

RESULTS = Path(__file__).parent / "results"
HEAD_DIM = 64
TILE = (4, 8, 8)  # 256 tokens per tile
WINDOW = (3, 3, 3)  # tiles
GRIDS = {4096: (4, 32, 32), 16384: (16, 32, 32), 32768: (16, 32, 64)}
HEADS = (4, 12)
REPEATS = {4096: 5, 16384: 3, 32768: 3}


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def case(tokens: int, heads: int) -> dict:
    grid = GRIDS[tokens]
    layout = TileLayout(
        grid,
        TILE,
        tuple(min(w, n) for w, n in zip(WINDOW, TileLayout(grid, TILE, (1, 1, 1)).tiles, strict=True)),
    )
    q, k, v = (torch.randn(1, heads, tokens, HEAD_DIM) for _ in range(3))
    runs = {
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v),
        **{
            name: partial(kernel, q, k, v, grid=grid, tile=layout.tile, window=layout.window)
            for name, kernel in (("gather", StaGather()), ("flex", StaFlex()))
        },
    }
    first = {name: timed(run) for name, run in runs.items()}  # flex: compile
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(REPEATS[tokens]):  # interleaved, so load changes hit every kernel alike
        for name, run in runs.items():
            times[name].append(timed(run))
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
        }
    print(json.dumps(row), flush=True)
    return row


def stats(times: list[float]) -> dict[str, float]:
    return {"min": round(min(times), 4), "median": round(statistics.median(times), 4)}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, style in (("gather", "o-"), ("flex", "s:")):
        for heads in HEADS:
            sel = [r for r in rows if r["heads"] == heads]
            ax.plot(
                [r["tokens"] for r in sel],
                [r[name]["speedup_min"] for r in sel],
                style,
                label=f"STA {name}, {heads} heads",
            )
    ax.plot(list(GRIDS), [rows[i]["speedup_limit"] for i in range(len(GRIDS))], "k--", label="limit 1/kept")
    ax.axhline(1.0, color="grey", lw=0.5)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens")
    ax.set_ylabel("dense SDPA time / STA time")
    ax.set_title(f"STA {TILE} tile, {WINDOW} window, fp32 CPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    torch.manual_seed(0)
    rows = [case(tokens, heads) for tokens in GRIDS for heads in HEADS]
    rows.sort(key=lambda r: (r["heads"], r["tokens"]))
    RESULTS.mkdir(exist_ok=True)
    meta = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "head_dim": HEAD_DIM,
        "dtype": "float32",
        "note": "shared machine: timings are noisy; min and median of the repeats",
    }
    (RESULTS / "sta_attention.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    plot(rows, RESULTS / "sta_attention.png")


if __name__ == "__main__":
    main()
