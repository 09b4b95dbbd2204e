"""Tile geometry: tile-major token order, padding and the sliding tile window.

Tokens of a (T, H, W) grid arrive t-major then h then w. STA pads the grid up to
whole tiles and orders tokens tile by tile (tiles t-major, tokens t-major inside a
tile), so each tile is one contiguous run of ``tile_volume`` tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch

Dims = tuple[int, int, int]


@dataclass(frozen=True)
class TileLayout:
    """A token grid cut into tiles, with a window of tiles per axis."""

    grid: Dims  # token grid (frames, height, width)
    tile: Dims  # tokens per tile along each axis
    window: Dims  # tiles each query tile sees along each axis

    def __post_init__(self) -> None:
        for name, dims in (("grid", self.grid), ("tile", self.tile), ("window", self.window)):
            if len(dims) != 3 or min(dims) < 1:
                raise ValueError(f"STA {name} must be three positive ints (t, h, w); got {dims!r}")
        too_big = [axis for axis, w, n in zip("thw", self.window, self.tiles, strict=True) if w > n]
        if too_big:
            raise ValueError(
                f"STA window {self.window} (tiles) exceeds the grid's {self.tiles} tiles on axis {too_big} "
                f"(grid {self.grid}, tile {self.tile}). Fix: use a window of at most {self.tiles} tiles."
            )

    @cached_property
    def tiles(self) -> Dims:
        """Tiles per axis (a partial edge tile counts as one)."""
        return tuple(math.ceil(n / t) for n, t in zip(self.grid, self.tile, strict=True))  # type: ignore[return-value]

    @property
    def padded_grid(self) -> Dims:
        return tuple(n * t for n, t in zip(self.tiles, self.tile, strict=True))  # type: ignore[return-value]

    @property
    def tile_volume(self) -> int:
        return math.prod(self.tile)

    @property
    def num_tiles(self) -> int:
        return math.prod(self.tiles)

    @property
    def padded_len(self) -> int:
        return self.num_tiles * self.tile_volume

    @property
    def kept_fraction(self) -> float:
        """Share of (query tile, key tile) pairs that are computed."""
        return math.prod(self.window) / self.num_tiles


def to_tiles(x: torch.Tensor, layout: TileLayout) -> torch.Tensor:
    """``[..., T*H*W, D]`` in grid order -> ``[..., padded_len, D]`` tile-major, zero padded."""
    lead, dim = x.shape[:-2], x.shape[-1]
    (nt, nh, nw), (tt, th, tw) = layout.tiles, layout.tile
    grid = x.reshape(-1, *layout.grid, dim)
    pads = [p - n for p, n in zip(layout.padded_grid, layout.grid, strict=True)]
    grid = torch.nn.functional.pad(grid, (0, 0, 0, pads[2], 0, pads[1], 0, pads[0]))
    tiled = grid.reshape(-1, nt, tt, nh, th, nw, tw, dim).permute(0, 1, 3, 5, 2, 4, 6, 7)
    return tiled.reshape(*lead, layout.padded_len, dim)


def from_tiles(x: torch.Tensor, layout: TileLayout) -> torch.Tensor:
    """Inverse of :func:`to_tiles`: drop padding, restore grid order."""
    lead, dim = x.shape[:-2], x.shape[-1]
    (nt, nh, nw), (tt, th, tw) = layout.tiles, layout.tile
    grid = x.reshape(-1, nt, nh, nw, tt, th, tw, dim).permute(0, 1, 4, 2, 5, 3, 6, 7)
    grid = grid.reshape(-1, *layout.padded_grid, dim)
    t, h, w = layout.grid
    return grid[:, :t, :h, :w].reshape(*lead, t * h * w, dim)


def real_tokens(layout: TileLayout) -> torch.Tensor:
    """``[padded_len]`` bool in tile-major order: True for grid tokens, False for padding."""
    ones = torch.ones(1, layout.grid[0] * layout.grid[1] * layout.grid[2], 1)
    return to_tiles(ones, layout).reshape(-1) > 0


def window_start(query_tile: torch.Tensor, width: int, tiles: int) -> torch.Tensor:
    """First key tile of the window centred on ``query_tile``, clamped so the window stays in the grid."""
    return (query_tile - width // 2).clamp(0, tiles - width)


def tile_neighbours(layout: TileLayout) -> torch.Tensor:
    """``[num_tiles, prod(window)]`` key-tile ids each query tile attends to (tile-major ids)."""
    nt, nh, nw = layout.tiles
    wt, wh, ww = layout.window
    qt, qh, qw = torch.meshgrid(torch.arange(nt), torch.arange(nh), torch.arange(nw), indexing="ij")
    st, sh, sw = (
        window_start(q.reshape(-1, 1), w, n)
        for q, w, n in zip((qt, qh, qw), layout.window, layout.tiles, strict=True)
    )
    ot, oh, ow = torch.meshgrid(torch.arange(wt), torch.arange(wh), torch.arange(ww), indexing="ij")
    kt, kh, kw = st + ot.reshape(1, -1), sh + oh.reshape(1, -1), sw + ow.reshape(1, -1)
    return (kt * nh + kh) * nw + kw
