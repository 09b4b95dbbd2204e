"""The measured effect of shapes-red-to-cyan.safetensors on wan2.1-t2v-shapes: every colour's prompts
(both shapes, all four directions, two seeds) served without and with the adapter per request, read by
the shapes detector (fv-train-flow): the object's mean colour and hue, and the detector's accuracy.
Writes the report as JSON. Run from the repository root:

    python examples/adapters/measure_red_to_cyan.py -o examples/adapters/red_to_cyan_effect.json
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

HERE = Path(__file__).resolve().parent
ADAPTER = HERE / "shapes-red-to-cyan.safetensors"


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
        **{f"acc_{k}": round(statistics.fmean(h[k] for h in hits), 3) for k in ("colour", "shape", "direction")},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--guidance", type=float, default=4.0)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("-o", "--output", type=Path)
    args = parser.parse_args()
    model = fv_core.load("wan2.1-t2v-shapes")
    model.instance.adapters.add("red-to-cyan", ADAPTER)
    report: dict = {"adapter": ADAPTER.name, "steps": args.steps, "guidance": args.guidance, "colours": {}}
    for colour in shapes.COLOURS:
        pairs = [
            (shapes.ClipSpec(colour, shape, direction, (0.0, 0.0)), seed)
            for shape in shapes.SHAPES
            for direction in shapes.DIRECTIONS
            for seed in range(args.seeds)
        ]
        row = {}
        for name, adapters in (("base", []), ("adapter", ["red-to-cyan"])):
            videos, _ = generate_videos(model, pairs, args.steps, args.guidance, "unipc", 16, adapters)
            row[name] = summary(pairs, videos)
        report["colours"][colour] = {"prompts": len(pairs), **row}
        print(colour, json.dumps(row))
    if args.output:
        args.output.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
