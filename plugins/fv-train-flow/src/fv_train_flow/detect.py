"""A hand-written detector for shapes clips: dominant colour, shape and motion direction.

Works on decoded frames [F, H, W, 3] in 0..1. The object is every pixel far from the background
colour (the median of the frame border); colour is the nearest palette entry to the object's mean
colour, shape comes from how much of its bounding box the object fills (square 1.0, circle pi/4),
direction from the centroid's travel between the first and last frames.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fv_train_flow.shapes import COLOURS, DIRECTIONS, ClipSpec

FOREGROUND = 0.2  # max per-channel distance from the background that still counts as background
SQUARE_FILL = (1.0 + torch.pi / 4) / 2  # fill ratio threshold between circle and square
MIN_PIXELS = 12  # fewer foreground pixels in a frame: no object found there


@dataclass(frozen=True, slots=True)
class Detection:
    """What the detector read from one clip; ``None`` where nothing could be read."""

    colour: str | None
    shape: str | None
    direction: str | None
    start: tuple[float, float] | None  # object centroid (x, y) in the first frame, pixels
    fill: float | None = None  # median over frames of object pixels / bounding-box pixels (shape's cue)

    def matches(self, spec: ClipSpec) -> dict[str, bool]:
        return {
            "colour": self.colour == spec.colour,
            "shape": self.shape == spec.shape,
            "direction": self.direction == spec.direction,
        }


def detect(frames: torch.Tensor) -> Detection:
    """Read colour, shape, direction and start position from frames [F, H, W, 3] in 0..1."""
    frames = frames.float()
    border = torch.cat([frames[:, 0], frames[:, -1], frames[:, :, 0], frames[:, :, -1]], dim=1)
    background = border.reshape(-1, 3).median(dim=0).values
    mask = (frames - background).abs().amax(-1) > FOREGROUND  # [F, H, W]
    counts = mask.flatten(1).sum(1)
    found = (counts >= MIN_PIXELS).nonzero().flatten().tolist()
    if not found:
        return Detection(None, None, None, None)
    pixels = frames[mask]
    palette = torch.tensor(list(COLOURS.values()))
    colour = list(COLOURS)[int(torch.cdist(pixels.mean(0, keepdim=True), palette).argmin())]
    fills = [_fill(mask[f]) for f in found]
    fill = float(torch.tensor(fills).median())
    shape = "square" if fill > SQUARE_FILL else "circle"
    first, last = _centroid(mask[found[0]]), _centroid(mask[found[-1]])
    direction = None
    if len(found) > 1:
        dx, dy = last[0] - first[0], last[1] - first[1]
        step = (
            (round(dx / max(abs(dx), 1e-6)), 0) if abs(dx) >= abs(dy) else (0, round(dy / max(abs(dy), 1e-6)))
        )
        direction = next(name for name, d in DIRECTIONS.items() if d == step)
    return Detection(colour, shape, direction, first if found[0] == 0 else None, round(fill, 4))


def _centroid(mask: torch.Tensor) -> tuple[float, float]:
    ys, xs = mask.nonzero(as_tuple=True)
    return float(xs.float().mean()) + 0.5, float(ys.float().mean()) + 0.5


def _fill(mask: torch.Tensor) -> float:
    """Object pixels over bounding-box pixels."""
    rows, cols = mask.any(1).nonzero().flatten(), mask.any(0).nonzero().flatten()
    box = (rows.max() - rows.min() + 1) * (cols.max() - cols.min() + 1)
    return float(mask.sum() / box)
