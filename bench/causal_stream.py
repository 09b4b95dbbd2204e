"""Causal Wan streaming: time to the first streamed frame against time to the whole video, and the
cost of each chunk as the video grows, with the rolling window against the full history (issue #21).

Usage: python bench/causal_stream.py [--chunks 24] [--repeats 3] [--threads 1] [--smoke]

A medium random-weight Wan T2V (``MEDIUM``: 8 layers, 8x64 heads) run as a causal card: chunks of one
latent frame, the card's 4 fixed steps per chunk, each chunk decoded and streamed as it is made.
``window``: the rolling KV window of 3 frames keeping 1 sink (the causal card's); ``full``: a window
holding every frame (what the cache costs without rolling). Per chunk the JSON holds the seconds
between its partial event and the one before (min and median over repeats); the PNG draws them.
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

MEDIUM = dict(num_attention_heads=8, attention_head_dim=64, ffn_dim=2048, num_layers=8)
SMOKE = dict(num_attention_heads=2, attention_head_dim=16, ffn_dim=64, num_layers=2)


def causal_model(folder: Path, side: int, frames: int):
    from fv_core import LoadedModel
    from fv_core.card import StepCostModel
    from fv_wan.cards import CAUSAL_TIMESTEPS, causal_card
    from fv_wan.model import CausalWanModel

    card = causal_card(
        "bench-causal",
        "bench: causal Wan on a random-weight folder",
        StepCostModel(base_s=0.01, per_token_s=1e-5),
        defaults=dict(
            num_frames=9, height=side, width=side, num_inference_steps=len(CAUSAL_TIMESTEPS), flow_shift=5.0,
            chunk_frames=1, context_timestep=0, window_frames=3, sink_frames=1,
        ),
        config=None, max_frames=frames, max_resolution=(side, side), kv_bytes=256 << 20,
    )  # fmt: skip
    return LoadedModel(card, CausalWanModel(card, folder), folder, source=card.model_id)


def timeline(model, chunks: int, window: int, sink: int, seed: int) -> tuple[float, list[float]]:
    """(seconds to the whole video, seconds at each chunk's partial event), from submission."""
    import torch

    from fv_core.runtime import Engine

    stamps: list[float] = []
    params = dict(prompt="a red circle moving left", num_frames=4 * (chunks - 1) + 1, seed=seed)
    request = model.prepare({**params, "window_frames": window, "sink_frames": sink})
    start = time.perf_counter()
    with torch.inference_mode():
        Engine(on_event=lambda e: e.kind == "partial" and stamps.append(time.perf_counter() - start)).run_one(
            *model.job(request)
        )
    return time.perf_counter() - start, stamps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, default=24)
    ap.add_argument("--side", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, 6 chunks, one repeat")
    ap.add_argument("--out", help="JSON path (default bench/results/causal_stream.json; --smoke: temp)")
    args = ap.parse_args()
    import torch

    from fv_wan.tiny import write_tiny_checkpoint

    torch.set_num_threads(args.threads)
    chunks, side, repeats = (6, 32, 1) if args.smoke else (args.chunks, args.side, args.repeats)
    policies = {"window": (3, 1), "full": (chunks, 0)}
    runs: dict[str, list[tuple[float, list[float]]]] = {name: [] for name in policies}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "wan"
        write_tiny_checkpoint(folder, transformer=SMOKE if args.smoke else MEDIUM)
        model = causal_model(folder, side, 4 * (chunks - 1) + 1)
        timeline(model, 2, 3, 1, 0)  # warm-up: components load
        for r in range(repeats):
            for name, (window, sink) in policies.items():
                runs[name].append(timeline(model, chunks, window, sink, r))
    result = {
        "checkpoint": {"transformer": SMOKE if args.smoke else MEDIUM, "weights": "random"},
        "request": {"latent_frames": chunks, "frames": 4 * (chunks - 1) + 1, "size": f"{side}x{side}",
                    "chunk_frames": 1, "steps_per_chunk": 4},
        "machine": {"cpu": platform.processor() or platform.machine(), "torch_threads": args.threads,
                    "repeats": repeats, "load_avg_1m": os.getloadavg()[0]},
    }  # fmt: skip
    for name, (window, sink) in policies.items():
        total = [t for t, _ in runs[name]]
        first = [s[0] for _, s in runs[name]]
        gaps = [[b - a for a, b in zip([0.0, *s], s, strict=False)] for _, s in runs[name]]
        per_chunk = [{"min": min(g[i] for g in gaps), "median": statistics.median(g[i] for g in gaps)}
                     for i in range(chunks)]  # fmt: skip
        later = [c["median"] for c in per_chunk[2:]]
        half = len(later) // 2
        result[name] = {
            "window_frames": window,
            "sink_frames": sink,
            "first_frame_s": {"min": min(first), "median": statistics.median(first)},
            "whole_video_s": {"min": min(total), "median": statistics.median(total)},
            "first_frame_vs_whole": statistics.median(first) / statistics.median(total),
            "chunk_s": per_chunk,
            # the mean chunk cost of the video's second half over its first (after two warm-up chunks)
            "late_vs_early_chunk_cost": (sum(later[half:]) / len(later[half:])) / (sum(later[:half]) / half),
        }
    result["goal"] = (
        "first frame long before the whole video; per-chunk cost flat as the video grows (window)"
    )
    result["note"] = (
        "chunk_s[i]: seconds between chunk i's partial event (its decoded frames) and chunk i-1's (chunk 0: "
        "from submission, with the prompt's encode); each chunk runs 4 denoise passes, its decode and one "
        "cache write over its context (at most the window's frames)"
    )
    default = Path(tempfile.gettempdir()) / "causal_stream_smoke.json" if args.smoke else None
    out = Path(args.out or default or Path(__file__).parent / "results" / "causal_stream.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    plot(out.with_suffix(".png"), result, chunks)
    print(json.dumps({k: {m: v for m, v in result[k].items() if m != "chunk_s"} for k in policies}, indent=1))


def plot(path: Path, result: dict, chunks: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for name, style in (("window", "o-"), ("full", "s--")):
        r = result[name]
        ax.plot(range(chunks), [c["median"] for c in r["chunk_s"]], style,
                label=f"{name} (window {r['window_frames']}): first frame {r['first_frame_s']['median']:.2f} s, "
                      f"whole {r['whole_video_s']['median']:.2f} s")  # fmt: skip
    ax.set_xlabel("chunk (one latent frame, 4 frames after the first)")
    ax.set_ylabel("seconds since the previous chunk (median)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    ax.set_title(f"Causal Wan streaming, medium random weights, {result['request']['size']}, CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
