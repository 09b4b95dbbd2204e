"""Drift of long causal rollouts under three KV policies at one memory budget (issue #22).

Usage: python bench/inferix_drift.py [--blocks 24] [--budget 6] [--threads 1] [--smoke]

Every (colour, shape, direction) combination of the shapes model is rolled out by the causal student
``wan2.1-t2v-shapes-causal`` in a session, one block (one latent frame, 4 video frames) at a time
after a first 9-frame request: each continuation's prompt steers the object back towards the centre
along its own axis ("moving left" when it is right of the centre...), so it stays in view however
long the video runs. The same rollouts run under

- ``full``: the whole history cached and attended (window of every block);
- ``rolling``: the card's rolling window at the budget (``--budget`` latent frames, the first kept);
- ``inferix``: fv-inferix at the same budget: the sink, the newest block and the 2 blocks each layer
  finds most relevant are attended; the least relevant block leaves when the cache is full;
- ``inferix-all-stored``: fv-inferix attending everything it stores (only its eviction differs).

Per block, fv's detector reads colour, shape and motion; drift is measured against the rollout's own
first block, in the spirit of LV-Bench's video drift error: the palette colour or shape changed from
block 0, the RGB distance of the object's mean colour and the change of its fill ratio (the shape's
cue); motion is right when the direction read over the block equals the one its prompt asked for.
Per block also the seconds of its transformer passes (median and min over rollouts) and the KV
cache's bytes (the pool's pages in use); the cost per block of one long request on a medium
random-weight Wan (where attention weighs); and the card's VAE alone on 17-frame ground-truth clips
(what the detector can read past 9 frames at all). Writes bench/results/inferix_drift.json and .png.
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
from typing import Any

import torch

from fv_core.extend import BaseObserver

REPO = Path(__file__).resolve().parents[1]
CARD = "wan2.1-t2v-shapes-causal"
SMOKE_CARD = "wan2.1-t2v-tiny-causal"
CENTRE = 32.0  # the shapes videos are 64 x 64
OPPOSITE = {"left": "right", "right": "left", "up": "down", "down": "up"}
DRIFT = ("colour_changed", "shape_changed", "colour_distance", "fill_change")  # vs block 0: lower is better
READS = ("in_view", "colour_ok", "shape_ok", "motion_ok", *DRIFT)  # what each block's detector read gives


def policies(blocks: int, budget: int) -> dict[str, tuple[dict[str, int], dict[str, Any] | None]]:
    """Name -> (window params, fv-inferix options or None)."""
    window = dict(window_frames=budget, sink_frames=1)
    return {
        "full": (dict(window_frames=blocks, sink_frames=1), None),
        "rolling": (window, None),
        "inferix": (window, dict(local_blocks=1, global_blocks=2)),
        "inferix-all-stored": (window, dict(local_blocks=1, global_blocks=budget)),
    }


class BlockClock(BaseObserver):
    """Seconds of the transformer passes and the pool's bytes in use, per absolute block."""

    def __init__(self, pool) -> None:
        self.pool, self.seconds, self.bytes = pool, {}, {}

    def on_step(self, state, plan, result) -> None:
        v = state.values
        if "chunk" not in v or not plan.label.startswith("chunk"):
            return
        block = v["offset"] + v["chunk"]
        if "decode" not in plan.label:
            self.seconds[block] = self.seconds.get(block, 0.0) + result.seconds
        self.bytes[block] = max(self.bytes.get(block, 0), self.pool.used_pages * self.pool.page_bytes)


def object_colour(frames: torch.Tensor) -> torch.Tensor | None:
    """Mean RGB of the object's pixels (the detector's foreground) in ``frames`` [F, H, W, 3]."""
    from fv_train_flow.detect import FOREGROUND, MIN_PIXELS

    border = torch.cat([frames[:, 0], frames[:, -1], frames[:, :, 0], frames[:, :, -1]], dim=1)
    background = border.reshape(-1, 3).median(dim=0).values
    mask = (frames - background).abs().amax(-1) > FOREGROUND
    return frames[mask].mean(0) if int(mask.sum()) >= MIN_PIXELS else None


def steer(frames: torch.Tensor, axis_of: str) -> str:
    """The direction along ``axis_of``'s axis that brings the object back towards the centre."""
    from fv_train_flow.detect import detect

    found = detect(frames[-1:])
    if found.start is None:  # nothing in view: keep the axis, any way
        return axis_of
    x, y = found.start
    if axis_of in ("left", "right"):
        return "left" if x > CENTRE else "right"
    return "up" if y > CENTRE else "down"


def rollout(model, engine: dict, combo: tuple[str, str, str], blocks: int, params: dict, seed: int):
    """One session: 9 frames asked with the combo's direction, then one block per request, steered.
    Returns the frames [F, H, W, 3] and the direction each block was asked for."""
    from fv_train_flow.shapes import caption

    colour, shape, direction = combo
    sid = model.open_session()
    asked, videos = [direction] * 3, []
    try:
        first = dict(prompt=caption(*combo), num_frames=9, seed=seed, session_id=sid, **params)
        videos.append(run(model, engine, first))
        for b in range(3, blocks):
            turn = steer(videos[-1], direction)
            asked.append(turn)
            ask = dict(
                prompt=caption(colour, shape, turn), num_frames=1, seed=seed + b, session_id=sid, **params
            )
            videos.append(run(model, engine, ask))
    finally:
        model.close_session(sid)
    return torch.cat(videos), asked


def run(model, engine: dict, params: dict) -> torch.Tensor:
    """One request on a fresh Engine(**engine)."""
    from fv_core.runtime import Engine

    request = model.prepare(params)
    with torch.inference_mode():
        result = Engine(**engine).run_one(*model.job(request))
    return result.outputs["frames"].float()


def read_blocks(frames: torch.Tensor, asked: list[str], combo: tuple[str, str, str]) -> list[dict[str, Any]]:
    """The detector per block (block 0: frame 0; block b: frames 4b-3 .. 4b), against block 0."""
    from fv_train_flow.detect import detect

    rows, first = [], None
    for b in range(len(asked)):
        span = frames[:1] if b == 0 else frames[4 * b - 3 : 4 * b + 1]
        seen = detect(span)
        colour = object_colour(span)
        moved = detect(frames[4 * b - 4 : 4 * b + 1]).direction if b else None
        row = {
            "in_view": seen.colour is not None,
            "colour": seen.colour,
            "shape": seen.shape,
            "fill": seen.fill,
            "rgb": colour.tolist() if colour is not None else None,
            "colour_ok": seen.colour == combo[0],
            "shape_ok": seen.shape == combo[1],
            "motion_ok": moved == asked[b] if b else None,
        }
        first = first or row
        row["colour_changed"] = row["colour"] != first["colour"]
        row["shape_changed"] = row["shape"] != first["shape"]
        row["colour_distance"] = (
            float(torch.dist(torch.tensor(row["rgb"]), torch.tensor(first["rgb"])))
            if row["rgb"] and first["rgb"]
            else None
        )
        row["fill_change"] = abs(row["fill"] - first["fill"]) if row["fill"] and first["fill"] else None
        rows.append(row)
    return rows


def fingerprint(folder: Path) -> str:
    """The first 16 hex digits of the sha256 of a folder's safetensors files (which weights ran)."""
    import hashlib

    digest = hashlib.sha256()
    for path in sorted(folder.glob("*.safetensors")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def mean(values: list) -> float | None:
    kept = [float(v) for v in values if v is not None]
    return round(sum(kept) / len(kept), 4) if kept else None


def per_block(reads: list[list[dict]], clocks: list[BlockClock], blocks: int) -> list[dict[str, Any]]:
    out = []
    for b in range(blocks):
        rows = [r[b] for r in reads]
        seconds = [c.seconds[b] for c in clocks if b in c.seconds]
        out.append(
            {
                "block": b,
                **{key: mean([r[key] for r in rows]) for key in READS},
                "seconds_median": round(statistics.median(seconds), 5) if seconds else None,
                "seconds_min": round(min(seconds), 5) if seconds else None,
                "cache_bytes": max((c.bytes.get(b, 0) for c in clocks), default=0),
            }
        )
    return out


def summary(blocks: list[dict[str, Any]], trained: int = 3) -> dict[str, Any]:
    """Means over the blocks past the trained span (3 latent frames), and the cost's growth: the median
    seconds of the last quarter of blocks over those of the first quarter past the trained span."""
    late = blocks[trained:]
    out = {key: mean([b[key] for b in late]) for key in (*DRIFT, "motion_ok", "in_view")}
    out.update({f"{k}_accuracy": mean([b[k] for b in late]) for k in ("colour_ok", "shape_ok")})
    quarter = max(len(late) // 4, 1)
    head = statistics.median([b["seconds_median"] for b in late[:quarter]])
    tail = statistics.median([b["seconds_median"] for b in late[-quarter:]])
    out["seconds_per_block_last_vs_first_quarter"] = round(tail / head, 3)
    out["peak_cache_bytes"] = max(b["cache_bytes"] for b in blocks)
    return out


def rollout_means(rows: list[dict[str, Any]], trained: int = 3) -> dict[str, float | None]:
    """One rollout's drift and motion, averaged over its blocks past the trained span."""
    return {key: mean([r[key] for r in rows[trained:]]) for key in (*DRIFT, "motion_ok")}


def paired(a: list[dict], b: list[dict]) -> dict[str, dict[str, float]]:
    """Per metric, the mean over rollouts of (a - b) on the same prompts and seeds, with a 95% interval."""
    out = {}
    for key in (*DRIFT, "motion_ok"):
        diffs = [
            x[key] - y[key] for x, y in zip(a, b, strict=True) if x[key] is not None and y[key] is not None
        ]
        centre = statistics.fmean(diffs)
        half = 1.96 * statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else float("inf")
        out[key] = {"mean": round(centre, 4), "ci95": [round(centre - half, 4), round(centre + half, 4)]}
    return out


def growth(seconds: list[float], budget: int) -> float:
    """Median seconds of the last quarter of blocks over those of the first quarter once the bounded
    policies' cache is full (block ``budget`` on)."""
    quarter = max(len(seconds) // 4, 1)
    return round(
        statistics.median(seconds[-quarter:]) / statistics.median(seconds[budget : budget + quarter]), 3
    )


def cost_sweep(blocks: int, budget: int, repeats: int, smoke: bool) -> dict[str, Any]:
    """Seconds per block of one long request on a medium random-weight causal Wan (where attention
    weighs), per policy: the full history grows, the bounded ones stay flat."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from causal_stream import MEDIUM, SMOKE, causal_model

    from fv_inferix import Inferix
    from fv_wan.tiny import write_tiny_checkpoint

    side = 32 if smoke else 256
    out: dict[str, Any] = {
        "checkpoint": SMOKE if smoke else MEDIUM,
        "size": f"{side}x{side}",
        "repeats": repeats,
    }
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "wan"
        write_tiny_checkpoint(folder, transformer=SMOKE if smoke else MEDIUM)
        model = causal_model(folder, side, 4 * (blocks - 1) + 1)
        out["tokens_per_block"] = (side // 16) ** 2
        for name, (params, options) in policies(blocks, budget).items():
            clocks = []
            for r in range(repeats + 1):  # the first run warms up
                clock = BlockClock(model.instance.kv_pool)
                engine = dict(interceptors=[Inferix(**options)] if options else [], observers=[clock])
                ask = dict(
                    prompt="a red circle moving left", num_frames=4 * (blocks - 1) + 1, seed=r, **params
                )
                run(model, engine, ask)
                if r:
                    clocks.append(clock)
            seconds = [[c.seconds[b] for c in clocks] for b in range(blocks)]
            fastest = [min(s) for s in seconds]  # the machine is shared: the min of repeats is the cost
            out[name] = {
                "seconds_per_block_median": [round(statistics.median(s), 5) for s in seconds],
                "seconds_per_block_min": [round(m, 5) for m in fastest],
                "last_vs_first_quarter": growth(fastest, budget),
                "peak_cache_bytes": max(max(c.bytes.values()) for c in clocks),
            }
            print("cost", name, out[name]["last_vs_first_quarter"], flush=True)
    return out


def vae_round_trip(model, clips: int = 24) -> dict[str, float]:
    """The card's VAE alone on ground truth: 17-frame shapes clips (a 9-frame clip, then back the way
    it came) encoded and decoded; the detector's colour on frames 0..8 and 8..16 (the part past the
    VAE's 9-frame training clips)."""
    from fv_train_flow import shapes
    from fv_train_flow.detect import detect
    from fv_wan import conditioning
    from fv_wan.bodies import decode_body

    vae, gen = model.instance.component("vae"), torch.Generator().manual_seed(0)
    right = {"early": 0, "late": 0}
    for _ in range(clips):
        spec = shapes.sample_spec(gen, shapes.ALL_COMBOS)
        dx, dy = shapes.DIRECTIONS[spec.direction]
        end = (spec.start[0] + dx * shapes.TRAVEL, spec.start[1] + dy * shapes.TRAVEL)
        back = shapes.ClipSpec(spec.colour, spec.shape, OPPOSITE[spec.direction], end)
        video = torch.cat([shapes.render(spec), shapes.render(back)[1:]])
        with torch.inference_mode():
            z = vae.encode(video.permute(3, 0, 1, 2)[None] * 2 - 1).latent_dist.mode()
            mean, inv_std = conditioning.latent_stats(vae, z)
            frames = decode_body(vae, {"latents": (z - mean) * inv_std})["frames"][0]
        right["early"] += detect(frames[:9]).colour == spec.colour
        right["late"] += detect(frames[8:]).colour == spec.colour
    return {
        "clips": clips,
        "colour_frames_0_8": right["early"] / clips,
        "colour_frames_8_16": right["late"] / clips,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=24, help="latent frames (blocks) per rollout")
    ap.add_argument("--budget", type=int, default=6, help="latent frames the bounded policies may cache")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3, help="runs per policy of the medium cost sweep")
    ap.add_argument(
        "--smoke", action="store_true", help="the tiny random causal card, 2 rollouts of 8 blocks"
    )
    ap.add_argument("--out", help="JSON path (default bench/results/inferix_drift.json; --smoke: temp)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import fv_core
    from fv_core.plugins import load_plugins
    from fv_inferix import Inferix
    from fv_train_flow.shapes import ALL_COMBOS

    blocks, budget = (8, 3) if args.smoke else (args.blocks, args.budget)
    combos = ALL_COMBOS[:2] if args.smoke else ALL_COMBOS
    model = fv_core.load(SMOKE_CARD if args.smoke else CARD, host=load_plugins())
    pool = model.instance.kv_pool
    results: dict[str, Any] = {}
    per_rollout: dict[str, list[dict]] = {}
    for name, (params, options) in policies(blocks, budget).items():
        t0 = time.perf_counter()
        reads, clocks = [], []
        for combo in combos:
            clock = BlockClock(pool)
            engine = dict(interceptors=[Inferix(**options)] if options else [], observers=[clock])
            frames, asked = rollout(model, engine, combo, blocks, params, args.seed)
            reads.append(read_blocks(frames, asked, combo))
            clocks.append(clock)
        table = per_block(reads, clocks, blocks)
        results[name] = {
            "params": params,
            "inferix_options": options,
            "summary": summary(table),
            "per_block": table,
            "seconds": round(time.perf_counter() - t0, 1),
        }
        per_rollout[name] = [rollout_means(r) for r in reads]
        print(name, json.dumps(results[name]["summary"]), flush=True)
    rolling, inferix = results["rolling"]["summary"], results["inferix"]["summary"]
    versus = paired(per_rollout["inferix"], per_rollout["rolling"])
    verdict = {
        # drift: lower is better, motion: higher; "not worse beyond noise": the paired 95% interval of
        # (inferix - rolling) reaches the side where inferix is as good or better
        "inferix_minus_rolling": versus,
        "inferix_drift_not_worse_beyond_noise": {k: versus[k]["ci95"][0] <= 0 for k in DRIFT},
        "inferix_drift_lower_mean_than_rolling": {k: inferix[k] <= rolling[k] for k in DRIFT},
        "inferix_motion_not_worse_beyond_noise": versus["motion_ok"]["ci95"][1] >= 0,
        "budget_held": all(
            results[p]["summary"]["peak_cache_bytes"] <= results["rolling"]["summary"]["peak_cache_bytes"]
            for p in ("inferix", "inferix-all-stored")
        ),  # fmt: skip
        "budget_vs_full_history": round(
            rolling["peak_cache_bytes"] / results["full"]["summary"]["peak_cache_bytes"], 3
        ),
    }
    vae = vae_round_trip(model) if not args.smoke else None  # the tiny card's VAE is random
    cost = cost_sweep(blocks, budget, 1 if args.smoke else args.repeats, args.smoke)
    out = {
        "bench": "inferix_drift",
        "card": model.card.model_id,
        "weights": str(model.weights),
        "transformer_sha256": fingerprint(Path(model.weights) / "transformer"),
        "rollouts_per_policy": len(combos),
        "blocks": blocks,
        "budget_frames": budget,
        "frames_per_block": 4,
        "seed": args.seed,
        "steering": "first 9 frames as the combination asks; then per block the direction back towards the "
        "centre along the combination's axis",
        "drift": "vs the rollout's own block 0; summaries average the blocks past the trained 3",
        "verdict": verdict,
        "policies": results,
        "cost_medium": cost,
        "vae_round_trip_17_frames": vae,
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "threads": args.threads,
            "load_avg": os.getloadavg(),
        },  # fmt: skip
    }
    default = Path(tempfile.gettempdir()) / "inferix_drift_smoke.json" if args.smoke else None
    path = Path(args.out or default or REPO / "bench/results/inferix_drift.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    plot(path.with_suffix(".png"), out)
    print(json.dumps(verdict))
    print(f"wrote {path}")


def plot(path: Path, out: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("colour_changed", "palette colour changed from block 0"),
        ("shape_changed", "shape changed from block 0"),
        ("colour_distance", "RGB distance from block 0's colour"),
        ("motion_ok", "motion as asked"),
        ("cache_bytes", "KV cache MiB"),
    ]
    fig, axes = plt.subplots(2, 3, figsize=(14, 7.5))
    for ax, (key, title) in zip(axes.flat, panels, strict=False):
        for name, result in out["policies"].items():
            rows = result["per_block"]
            xs = [r["block"] for r in rows if r[key] is not None]
            ys = [r[key] / (1 << 20) if key == "cache_bytes" else r[key] for r in rows if r[key] is not None]
            ax.plot(xs, ys, marker=".", label=name)
        ax.axvline(2.5, color="grey", lw=0.6, ls=":")  # past here: longer than the student trained on
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("block (latent frame)")
    cost, ax = out["cost_medium"], axes.flat[5]
    for name in out["policies"]:
        ax.plot(cost[name]["seconds_per_block_min"], marker=".", label=name)
    ax.set_title(f"seconds per block, medium Wan {cost['size']} (min of {cost['repeats']})", fontsize=10)
    ax.set_xlabel("block (latent frame)")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(
        f"{out['card']}: {out['rollouts_per_policy']} steered rollouts of {out['blocks']} blocks, budget "
        f"{out['budget_frames']} frames (bounded policies)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    main()
