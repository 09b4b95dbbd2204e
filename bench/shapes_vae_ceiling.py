"""The shapes card's ceiling: what the detector reads on real clips after the card's VAE round trip.

A generated video can be no better than the VAE decoding the best latent, so this renders real clips
of every caption (random starts, as the training data draws them), encodes them with the card's VAE
(the posterior's mode), decodes them and runs the detector ``fv eval`` uses. Per caption: shape
accuracy, the median fill ratio (the detector calls a fill above SQUARE_FILL a square) and the
same on the raw clips. Squares through this VAE land a few hundredths above the threshold, so the
square/circle call of a generated square has little margin. Writes
bench/results/shapes_vae_ceiling.json.

    python bench/shapes_vae_ceiling.py            # 48 captions x 16 clips
    python bench/shapes_vae_ceiling.py --smoke    # 2 clips a caption
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

import fv_core
from fv_train_flow import shapes
from fv_train_flow.detect import SQUARE_FILL, detect

RESULTS = Path(__file__).resolve().parents[1] / "bench/results"


def round_trip(vae: torch.nn.Module, clips: torch.Tensor) -> torch.Tensor:
    """Frames [B, F, H, W, 3] in 0..1 through the VAE (encode to the posterior's mode, decode)."""
    video = clips.permute(0, 4, 1, 2, 3) * 2 - 1
    with torch.inference_mode():
        decoded = vae.decode(vae.encode(video).latent_dist.mode()).sample
    return ((decoded.clamp(-1, 1) + 1) / 2).permute(0, 2, 3, 4, 1)


def caption_row(vae: torch.nn.Module, combo: tuple[str, str, str], clips: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    specs = [shapes.sample_spec(gen, (combo,)) for _ in range(clips)]
    raw = torch.stack([shapes.render(s) for s in specs])
    found = [detect(f) for f in round_trip(vae, raw)]
    return {
        "shape": round(sum(d.shape == combo[1] for d in found) / clips, 4),
        "fill_median": round(statistics.median(d.fill for d in found), 4),
        "fill_min": round(min(d.fill for d in found), 4),
        "raw_fill_median": round(statistics.median(detect(c).fill for c in raw), 4),
        "held_out": combo in shapes.HELD_OUT,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--card", default="wan2.1-t2v-shapes")
    ap.add_argument("--clips", type=int, default=16, help="clips per caption")
    ap.add_argument("--smoke", action="store_true", help="2 clips per caption")
    ap.add_argument("--out", help="default bench/results/shapes_vae_ceiling.json; --smoke: the temp dir")
    args = ap.parse_args()
    torch.set_num_threads(1)
    clips = 2 if args.smoke else args.clips
    model = fv_core.load(args.card)
    vae = model.instance.component("vae")
    rows = {
        shapes.caption(*combo): caption_row(vae, combo, clips, seed=i)
        for i, combo in enumerate(shapes.ALL_COMBOS)
    }
    model.close()
    groups = {}
    for shape in shapes.SHAPES:
        for held in (False, True):
            picked = [r for c, r in rows.items() if shape in c and r["held_out"] == held]
            groups[f"{shape}{'_held_out' if held else '_seen'}"] = {
                "shape": round(statistics.fmean(r["shape"] for r in picked), 4),
                "fill_median": round(statistics.median(r["fill_median"] for r in picked), 4),
            }
    report = {
        "settings": {"card": args.card, "clips_per_caption": clips, "smoke": args.smoke},
        "square_fill_threshold": round(SQUARE_FILL, 4),
        "shape_accuracy": round(statistics.fmean(r["shape"] for r in rows.values()), 4),
        "held_out_shape_accuracy": round(
            statistics.fmean(r["shape"] for r in rows.values() if r["held_out"]), 4
        ),
        "groups": groups,
        "by_caption": rows,
    }
    out = Path(
        args.out or (Path(tempfile.gettempdir()) if args.smoke else RESULTS) / "shapes_vae_ceiling.json"
    )
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(
        json.dumps({k: report[k] for k in ("shape_accuracy", "held_out_shape_accuracy", "groups")}, indent=1)
    )


if __name__ == "__main__":
    main()
