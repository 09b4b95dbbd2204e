"""``fv eval``: C4 quality of a shapes model, measured by the detector on videos the serve loop makes.

The prompt set is fixed: every held-out (colour, shape, direction) combination plus an even spread
of training combinations, each prompted with several seeds. Reported per group ("seen",
"held_out", "all"): accuracy per attribute, and diversity, the spread of the object's start
position across the seeds of one prompt, next to the same spread over real clips; and per caption
(``by_caption``) accuracy, median fill and mean start distance from the centre.
"""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from fv_train_flow import shapes
from fv_train_flow.detect import Detection, detect

ATTRIBUTES = ("colour", "shape", "direction")
SEEN_CAPTIONS = 10  # training combinations in the prompt set (plus all held-out ones)
STRIP_VIDEOS = 8  # videos shown in the sample strip


def prompt_set(n: int) -> list[tuple[shapes.ClipSpec, int]]:
    """``n`` (combination, seed) pairs: the held-out and an even spread of seen combinations, each
    repeated with seeds 0, 1, ... (the spec's start is unused: the model chooses it)."""
    seen = shapes.TRAIN_COMBOS[:: max(1, len(shapes.TRAIN_COMBOS) // SEEN_CAPTIONS)][:SEEN_CAPTIONS]
    combos = sorted(shapes.HELD_OUT) + list(seen)
    return [(shapes.ClipSpec(*combos[i % len(combos)], (0.0, 0.0)), i // len(combos)) for i in range(n)]


def generate_videos(
    model: Any,
    pairs: list[tuple[shapes.ClipSpec, int]],
    steps: int,
    guidance: float,
    sampler: str,
    max_sequence_length: int | None = None,
    adapters: list[Any] | None = None,
) -> tuple[list[torch.Tensor], float]:
    """Frames [F, H, W, 3] per pair through the serve engine (compatible steps batched); seconds/video.
    ``max_sequence_length``: prompt padding (default: the card's); ``adapters``: served LoRAs every
    request runs (``LoadedModel.prepare``)."""
    from fv_core.runtime import Engine

    params = dict(
        num_frames=shapes.FRAMES,
        height=shapes.SIZE,
        width=shapes.SIZE,
        num_inference_steps=steps,
        guidance_scale=guidance,
        sampler=sampler,
        max_sequence_length=max_sequence_length,
    )
    items = [
        model.job(model.prepare({**params, "prompt": spec.caption, "seed": seed}, adapters=adapters or ()))
        for spec, seed in pairs
    ]
    start = time.perf_counter()
    with torch.inference_mode():
        results = Engine(max_batch_rows=64).run_batched(items)
    seconds = (time.perf_counter() - start) / len(pairs)
    return [r.outputs["frames"].cpu() for r in results], seconds


def score(
    pairs: list[tuple[shapes.ClipSpec, int]], detections: list[Detection]
) -> dict[str, dict[str, float]]:
    """Accuracy per attribute, start-position spread and the median fill ratio per requested shape
    (the detector calls a fill above ``SQUARE_FILL`` a square), per group."""
    groups: dict[str, list[int]] = {"seen": [], "held_out": [], "all": list(range(len(pairs)))}
    for i, (spec, _) in enumerate(pairs):
        key = (spec.colour, spec.shape, spec.direction)
        groups["held_out" if key in shapes.HELD_OUT else "seen"].append(i)
    report = {}
    for group, idx in groups.items():
        hits = [detections[i].matches(pairs[i][0]) for i in idx]
        row: dict[str, float | None] = {
            a: round(sum(h[a] for h in hits) / max(1, len(hits)), 4) for a in ATTRIBUTES
        }
        row["joint"] = round(sum(all(h.values()) for h in hits) / max(1, len(hits)), 4)
        row["start_spread"] = round(
            _spread([pairs[i][0].caption for i in idx], [detections[i].start for i in idx]), 3
        )
        for shape in shapes.SHAPES:  # where the shape cue sits, next to the detector's threshold
            fills = [f for i in idx if pairs[i][0].shape == shape and (f := detections[i].fill) is not None]
            row[f"{shape}_fill_median"] = round(statistics.median(fills), 4) if fills else None
        row["n"] = len(idx)
        report[group] = row
    report["by_caption"] = by_caption(pairs, detections)
    return report


def by_caption(
    pairs: list[tuple[shapes.ClipSpec, int]], detections: list[Detection]
) -> dict[str, dict[str, float | int | bool | None]]:
    """Accuracy per attribute, the median fill and the mean start distance from the frame's centre
    per caption: a group's misses often sit in one combination."""
    rows: dict[str, list[int]] = {}
    for i, (spec, _) in enumerate(pairs):
        rows.setdefault(spec.caption, []).append(i)
    centre = shapes.SIZE / 2
    out = {}
    for caption, idx in rows.items():
        spec, found = pairs[idx[0]][0], [detections[i] for i in idx]
        hits = [d.matches(spec) for d in found]
        fills = [d.fill for d in found if d.fill is not None]
        dists = [math.dist(d.start, (centre, centre)) for d in found if d.start is not None]
        out[caption] = {
            **{a: round(sum(h[a] for h in hits) / len(hits), 4) for a in ATTRIBUTES},
            "fill_median": round(statistics.median(fills), 4) if fills else None,
            "start_distance": round(statistics.fmean(dists), 2) if dists else None,
            "held_out": (spec.colour, spec.shape, spec.direction) in shapes.HELD_OUT,
            "n": len(idx),
        }
    return out


def real_spread(pairs: list[tuple[shapes.ClipSpec, int]], seed: int = 99) -> float:
    """The start-position spread of real clips over the same captions and number of seeds."""
    gen = torch.Generator().manual_seed(seed)
    specs = [shapes.sample_spec(gen, ((s.colour, s.shape, s.direction),)) for s, _ in pairs]
    return round(_spread([s.caption for s in specs], [s.start for s in specs]), 3)


def _spread(captions: list[str], starts: list[tuple[float, float] | None]) -> float:
    """Mean over captions of the std of start x and y across that caption's samples (pixels)."""
    by_caption: dict[str, list[tuple[float, float]]] = {}
    for caption, start in zip(captions, starts, strict=True):
        if start is not None:
            by_caption.setdefault(caption, []).append(start)
    stds = [
        statistics.pstdev([p[axis] for p in pts])
        for pts in by_caption.values()
        if len(pts) > 1
        for axis in (0, 1)
    ]
    return statistics.fmean(stds) if stds else 0.0


def evaluate_model(
    model: Any,
    prompts: int,
    steps: int,
    guidance: float,
    sampler: str = "unipc",
    strip: Path | None = None,
    max_sequence_length: int | None = None,
    adapters: list[Any] | None = None,
) -> dict[str, Any]:
    """One (sampler, steps, guidance) cell: accuracy, diversity and generation time."""
    pairs = prompt_set(prompts)
    videos, seconds = generate_videos(model, pairs, steps, guidance, sampler, max_sequence_length, adapters)
    report: dict[str, Any] = score(pairs, [detect(v) for v in videos])
    report["settings"] = {"sampler": sampler, "steps": steps, "guidance": guidance, "prompts": prompts}
    report["real_start_spread"] = real_spread(pairs)
    report["seconds_per_video"] = round(seconds, 4)
    if strip is not None:
        count = min(len(pairs), STRIP_VIDEOS)
        held = [(s.colour, s.shape, s.direction) in shapes.HELD_OUT for s, _ in pairs[:count]]
        labels = [
            f"{s.colour} {s.shape}\nmoving {s.direction}" + ("\n(held out)" if h else "")
            for (s, _), h in zip(pairs, held, strict=False)
        ]
        save_strip(videos[:count], labels, strip)
    return report


def evaluate_grid(
    model: Any,
    prompts: int,
    steps: list[int],
    guidance: list[float],
    samplers: list[str],
    strip: Path | None = None,
) -> dict[str, Any]:
    """Every (sampler, steps, guidance) cell; the strip shows the last cell's first videos."""
    cells = [(s, n, g) for s in samplers for n in steps for g in guidance]
    results = [
        evaluate_model(model, prompts, n, g, s, strip if i == len(cells) - 1 else None)
        for i, (s, n, g) in enumerate(cells)
    ]
    return {"held_out_combinations": sorted(map(list, shapes.HELD_OUT)), "results": results}


def evaluate_folder(
    weights: Path,
    prompts: int,
    steps: int,
    guidance: float,
    sampler: str = "unipc",
    card: str = "wan2.1-t2v-tiny",
    max_sequence_length: int | None = None,
) -> dict[str, Any]:
    """``evaluate_model`` on a checkpoint folder served by the Wan card ``card``."""
    model = load(card, weights)
    return evaluate_model(model, prompts, steps, guidance, sampler, None, max_sequence_length)


def load(card: str | None, weights: Path | str | None, device: str = "cpu") -> Any:
    """``card`` on ``weights`` on ``device``; with no card, the card built from the folder's own configs."""
    import fv_core

    return fv_core.load(card, weights, device=device)


def save_strip(
    videos: list[torch.Tensor], captions: list[str], path: Path, frames: tuple[int, ...] = (0, 2, 4, 6, 8)
) -> None:
    """A PNG grid: one column per video (its ``frames`` top to bottom), captioned on top."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        len(frames), len(videos), figsize=(1.25 * len(videos), 1.25 * len(frames) + 0.8), squeeze=False
    )
    for col, (video, caption) in enumerate(zip(videos, captions, strict=True)):
        for row, f in enumerate(frames):
            ax = axes[row][col]
            ax.imshow(video[f].clamp(0, 1).numpy())
            ax.set_xticks([])
            ax.set_yticks([])
            if row == 0:
                ax.set_title(caption, fontsize=7)
            if col == 0:
                ax.set_ylabel(f"frame {f}", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
