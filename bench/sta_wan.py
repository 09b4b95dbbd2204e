"""One Wan transformer forward at 16k tokens: STA vs dense SDPA as the self-attention kernel, fp32 on CPU.

Both kernels are selected from the kernels registry (fv-sta's options bound) and
installed on every block's self-attention exactly as ``WanModel`` does; the
forward is fv's block-granular ``wan_forward_kv``, so the speedup is end to end
(projections, feed-forward, cross-attention and tile reordering included). On
CPU the registry's STA is the gather kernel; first calls are reported apart
from the steady-state times.
Writes bench/results/sta_wan.json. Run: python bench/sta_wan.py
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from diffusers import WanTransformer3DModel

import fv_sta.plugin
from fv_core.kernels_select import select_kernel
from fv_core.plugins import PluginHost
from fv_sta.options import StaOptions, StaWindow
from fv_sta.tiles import TileLayout
from fv_wan.attention import describe, grid_of, install
from fv_wan.transformer import text_kv, wan_forward_kv

RESULTS = Path(__file__).parent / "results"
CARD = "bench-wan"
CONFIG: dict[str, Any] = dict(  # a medium Wan: 12 x 64 heads, 2 blocks
    patch_size=(1, 2, 2),
    num_attention_heads=12,
    attention_head_dim=64,
    in_channels=16,
    out_channels=16,
    text_dim=4096,
    freq_dim=256,
    ffn_dim=3072,
    num_layers=2,
    rope_max_seq_len=1024,
)
LATENTS = (1, 16, 16, 64, 64)  # [B, C, T, H, W] -> token grid (16, 32, 32) = 16384 tokens
TEXT_TOKENS = 512
TILE, WINDOW = (4, 8, 8), (3, 3, 3)  # 4 x 4 x 4 tiles, each query tile sees 27 of 64
REPEATS = 3


def timed(fn) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def stats(times: list[float]) -> dict[str, float]:
    return {"min": round(min(times), 3), "median": round(statistics.median(times), 3)}


def main() -> None:
    torch.manual_seed(0)
    host = PluginHost(env={})
    host.add(fv_sta.plugin, "fv-sta")
    host.collect()
    options = StaOptions(windows=[StaWindow(card=CARD, tile=TILE, window=WINDOW)])
    model = WanTransformer3DModel(**CONFIG)
    latents, text = torch.randn(LATENTS), torch.randn(1, TEXT_TOKENS, CONFIG["text_dim"])
    timestep = torch.tensor([500.0])
    grid = grid_of(latents, CONFIG["patch_size"])
    with torch.no_grad():
        kv = text_kv(model, text)

        def forward() -> torch.Tensor:
            return wan_forward_kv(model, latents, timestep, kv)

        kernels = {v: select_kernel(host.registries, "attention", v, "cpu", options) for v in ("sdpa", "sta")}
        first, times, outputs = {}, {v: [] for v in kernels}, {}
        for variant, (impl, _) in kernels.items():
            install(model, impl, CARD)
            first[variant], _ = timed(forward)  # STA: its masks/indices (and compile, on the flex path)
        for _ in range(REPEATS):  # interleaved, so load changes hit both kernels alike
            for variant, (impl, _) in kernels.items():
                install(model, impl, CARD)
                seconds, outputs[variant] = timed(forward)
                times[variant].append(seconds)
        rows: dict[str, dict[str, Any]] = {
            variant: {
                "kernel": describe(impl, record, CARD, grid, latents),
                "first_call_s": round(first[variant], 3),
                "forward_s": stats(times[variant]),
            }
            for variant, (impl, record) in kernels.items()
        }
        print(json.dumps(rows, default=str), flush=True)
    layout = TileLayout(grid, TILE, WINDOW)
    dense, sta = rows["sdpa"]["forward_s"], rows["sta"]["forward_s"]
    result = {
        "meta": {
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "cpu": platform.processor() or platform.machine(),
            "dtype": "float32",
            "config": CONFIG,
            "latents": LATENTS,
            "tokens": layout.grid[0] * layout.grid[1] * layout.grid[2],
            "text_tokens": TEXT_TOKENS,
            "kept_fraction": round(layout.kept_fraction, 4),
            "note": "shared, noisy 2-core machine: min and median of the repeats",
        },
        "rows": rows,
        "speedup_min": round(dense["min"] / sta["min"], 2),
        "speedup_median": round(dense["median"] / sta["median"], 2),
        "sta_vs_dense_rel_diff": round(
            float((outputs["sta"] - outputs["sdpa"]).norm() / outputs["sdpa"].norm()), 4
        ),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "sta_wan.json").write_text(json.dumps(result, indent=2))
    print(json.dumps({k: result[k] for k in ("speedup_min", "speedup_median")}))


if __name__ == "__main__":
    main()
