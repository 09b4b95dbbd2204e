"""The measured effect of a shapes LoRA on wan2.1-t2v-shapes: every colour's prompts (both shapes, all
four directions, one seed, at the card's 30 steps and guidance 1) served without and with the adapter per
request, read by the shapes detector (fv-train-flow): the object's mean colour and hue, and the
detector's accuracy per attribute. Writes the report as JSON. Run from the repository root:

    python examples/adapters/measure.py examples/adapters/shapes-red-to-green.safetensors \
        -o examples/adapters/shapes-red-to-green.json
"""

from __future__ import annotations

import argparse
import colorsys
import json
import statistics
from pathlib import Path

import torch

import fv_core
from fv_train_flow import shapes
from fv_train_flow.detect import FOREGROUND, detect
from fv_train_flow.eval import generate_videos


def object_rgb(frames: torch.Tensor) -> tuple[float, float, float] | None:
    """Mean colour of the object's pixels (those far from the border's median colour, as the detector
    finds them); None when there is no object."""
    frames = frames.float()
    border = torch.cat([frames[:, 0], frames[:, -1], frames[:, :, 0], frames[:, :, -1]], dim=1)
    mask = (frames - border.reshape(-1, 3).median(0).values).abs().amax(-1) > FOREGROUND
    return tuple(round(float(c), 3) for c in frames[mask].mean(0)) if mask.any() else None


def summary(pairs, videos) -> dict:
    rgbs = [rgb for v in videos if (rgb := object_rgb(v)) is not None]
    hits = [detect(v).matches(spec) for v, (spec, _) in zip(videos, pairs, strict=True)]
    mean = tuple(round(statistics.fmean(c[i] for c in rgbs), 3) for i in range(3)) if rgbs else None
    return {
        "mean_object_rgb": mean,
        "hue_deg": round(colorsys.rgb_to_hsv(*mean)[0] * 360, 1) if mean else None,
        **{
            f"acc_{k}": round(statistics.fmean(h[k] for h in hits), 3)
            for k in ("colour", "shape", "direction")
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("adapter", type=Path, help="a LoRA file for wan2.1-t2v-shapes")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--guidance", type=float, default=1.0)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("-o", "--output", type=Path)
    args = parser.parse_args()
    model = fv_core.load("wan2.1-t2v-shapes")
    model.instance.adapters.add("measured", args.adapter)
    report: dict = {
        "adapter": args.adapter.name,
        "steps": args.steps,
        "guidance": args.guidance,
        "colours": {},
    }
    for colour in shapes.COLOURS:
        pairs = [
            (shapes.ClipSpec(colour, shape, direction, (0.0, 0.0)), seed)
            for shape in shapes.SHAPES
            for direction in shapes.DIRECTIONS
            for seed in range(args.seeds)
        ]
        row = {}
        for name, adapters in (("base", []), ("adapter", ["measured"])):
            videos, _ = generate_videos(model, pairs, args.steps, args.guidance, "unipc", 16, adapters)
            row[name] = summary(pairs, videos)
        report["colours"][colour] = {"prompts": len(pairs), **row}
        print(colour, json.dumps(row))
    if args.output:
        args.output.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
