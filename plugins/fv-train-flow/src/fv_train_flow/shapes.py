"""Synthetic shapes clips: one coloured circle or square moving in one direction on a plain background.

Deterministic by seed and unlimited: clip ``i`` of seed ``s`` is always the same. Some
(colour, shape, direction) combinations are held out of training so evaluation can measure
generalisation to unseen captions, not only memorised ones.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

COLOURS: dict[str, tuple[float, float, float]] = {
    "red": (0.95, 0.12, 0.12),
    "orange": (1.0, 0.55, 0.05),
    "yellow": (0.95, 0.92, 0.1),
    "green": (0.1, 0.8, 0.2),
    "blue": (0.15, 0.3, 1.0),
    "purple": (0.6, 0.15, 0.85),
}
SHAPES = ("circle", "square")
DIRECTIONS: dict[str, tuple[float, float]] = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
BACKGROUND = (0.12, 0.12, 0.12)

FRAMES, SIZE = 9, 64  # 4k+1 frames for Wan's VAE; a multiple of 16 pixels
HALF = 12.0  # half the side of the square / the circle's radius, pixels
TRAVEL = 24.0  # pixels moved from the first to the last frame

# One held-out combination per colour: every word is still seen in training, in other combinations.
HELD_OUT: frozenset[tuple[str, str, str]] = frozenset(
    (colour, SHAPES[i % 2], tuple(DIRECTIONS)[(i + i // 2) % 4]) for i, colour in enumerate(COLOURS)
)
ALL_COMBOS: tuple[tuple[str, str, str], ...] = tuple(itertools.product(COLOURS, SHAPES, DIRECTIONS))
TRAIN_COMBOS = tuple(c for c in ALL_COMBOS if c not in HELD_OUT)


@dataclass(frozen=True, slots=True)
class ClipSpec:
    """What one clip shows."""

    colour: str  # key of COLOURS
    shape: str  # one of SHAPES
    direction: str  # key of DIRECTIONS
    start: tuple[float, float]  # (x, y) centre in the first frame, pixels

    @property
    def caption(self) -> str:
        return caption(self.colour, self.shape, self.direction)


def caption(colour: str, shape: str, direction: str) -> str:
    return f"a {colour} {shape} moving {direction}"


def vocabulary() -> list[str]:
    """Every word a caption can contain."""
    return ["a", "moving", *COLOURS, *SHAPES, *DIRECTIONS]


def sample_spec(
    generator: torch.Generator, combos: tuple[tuple[str, str, str], ...] = TRAIN_COMBOS
) -> ClipSpec:
    """A random clip among ``combos`` with a random start that keeps the whole path inside the frame."""
    colour, shape, direction = combos[int(torch.randint(len(combos), (1,), generator=generator))]
    dx, dy = DIRECTIONS[direction]
    lo, hi = HALF + 1, SIZE - HALF - 1
    u = torch.rand(2, generator=generator).tolist()
    # Along the motion axis the start leaves room for TRAVEL; across it the range is the full frame.
    x = lo + u[0] * (hi - lo - TRAVEL * abs(dx)) + (TRAVEL if dx < 0 else 0.0)
    y = lo + u[1] * (hi - lo - TRAVEL * abs(dy)) + (TRAVEL if dy < 0 else 0.0)
    return ClipSpec(colour, shape, direction, (x, y))


def render(spec: ClipSpec, recolour: dict[str, tuple[float, float, float]] | None = None) -> torch.Tensor:
    """The clip as frames [F, H, W, 3] in 0..1, anti-aliased (one pixel of soft edge); ``recolour``
    draws the named colours in other RGB values (the caption still names the colour)."""
    coords = torch.arange(SIZE, dtype=torch.float32) + 0.5
    yy, xx = torch.meshgrid(coords, coords, indexing="ij")
    dx, dy = DIRECTIONS[spec.direction]
    rgb = (recolour or {}).get(spec.colour, COLOURS[spec.colour])
    colour, background = torch.tensor(rgb), torch.tensor(BACKGROUND)
    frames = []
    for f in range(FRAMES):
        step = TRAVEL * f / (FRAMES - 1)
        cx, cy = spec.start[0] + dx * step, spec.start[1] + dy * step
        if spec.shape == "circle":
            dist = torch.sqrt((xx - cx) ** 2 + (yy - cy) ** 2)
        else:
            dist = torch.maximum((xx - cx).abs(), (yy - cy).abs())
        alpha = (HALF - dist + 0.5).clamp(0, 1).unsqueeze(-1)
        frames.append(alpha * colour + (1 - alpha) * background)
    return torch.stack(frames)


def render_long(spec: ClipSpec, frames: int, generator: torch.Generator) -> torch.Tensor:
    """``frames`` (4k+1) frames [F, H, W, 3]: straight legs of TRAVEL pixels over FRAMES - 1 frames, the
    first one ``spec``'s; after each leg the object goes on the same way when that stays in view (half
    the time), else turns to a random direction that does (turning back always does)."""
    lo, hi = HALF + 1, SIZE - HALF - 1
    legs, leg = [render(spec)], spec
    while sum(len(x) for x in legs) - (len(legs) - 1) < frames:
        dx, dy = DIRECTIONS[leg.direction]
        end = (leg.start[0] + dx * TRAVEL, leg.start[1] + dy * TRAVEL)
        fits = [
            d
            for d, (ex, ey) in DIRECTIONS.items()
            if lo <= end[0] + ex * TRAVEL <= hi and lo <= end[1] + ey * TRAVEL <= hi
        ]
        keep = leg.direction in fits and float(torch.rand(1, generator=generator)) < 0.5
        turn = leg.direction if keep else fits[int(torch.randint(len(fits), (1,), generator=generator))]
        leg = ClipSpec(leg.colour, leg.shape, turn, end)
        legs.append(render(leg)[1:])
    return torch.cat(legs)[:frames]


def stream_specs(
    seed: int, index: int, size: int, combos: tuple[tuple[str, str, str], ...] = TRAIN_COMBOS
) -> list[ClipSpec]:
    """What clips ``index .. index+size`` of the stream ``seed`` show, without rendering them."""
    return [
        sample_spec(torch.Generator().manual_seed(seed * 1_000_003 + index + i), combos) for i in range(size)
    ]


def batch(
    seed: int,
    index: int,
    size: int,
    combos: tuple[tuple[str, str, str], ...] = TRAIN_COMBOS,
    recolour: dict[str, tuple[float, float, float]] | None = None,
) -> tuple[torch.Tensor, list[ClipSpec]]:
    """Clips ``index .. index+size`` of the stream ``seed``: video [B, 3, F, H, W] in -1..1 and specs."""
    specs = stream_specs(seed, index, size, combos)
    video = torch.stack([render(s, recolour) for s in specs]).permute(0, 4, 1, 2, 3) * 2 - 1
    return video, specs


def long_batch(
    seed: int, index: int, size: int, frames: int, combos: tuple[tuple[str, str, str], ...] = TRAIN_COMBOS
) -> tuple[torch.Tensor, list[ClipSpec]]:
    """Clips ``index .. index+size`` of the stream ``seed`` made ``frames`` long with ``render_long``:
    video [B, 3, F, H, W] in -1..1 and each clip's first leg."""
    specs = stream_specs(seed, index, size, combos)
    clips = [
        render_long(s, frames, torch.Generator().manual_seed(seed * 1_000_003 + index + i))
        for i, s in enumerate(specs)
    ]
    return torch.stack(clips).permute(0, 4, 1, 2, 3) * 2 - 1, specs


class ShapesDataset:
    """The training stream as a registered dataset (``shapes``): the training combinations' clips."""

    def batch(self, seed: int, index: int, size: int) -> tuple[torch.Tensor, list[str]]:
        video, specs = batch(seed, index, size)
        return video, [s.caption for s in specs]
