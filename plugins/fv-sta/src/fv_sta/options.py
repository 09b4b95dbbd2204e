"""Deploy-file options of fv-sta: the tile window per card and token grid.

Example (deploy YAML)::

    plugin_options:
      fv-sta:
        windows:
          - {card: wan2.1-t2v-1.3b, grid: [21, 30, 52], tile: [3, 6, 8], window: [3, 3, 3]}
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from fv_sta.tiles import Dims, TileLayout

DEFAULT_TILE: Dims = (4, 8, 8)
DEFAULT_WINDOW: Dims = (3, 3, 3)
ANY_CARD = "*"


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StaWindow(Strict):
    """The STA geometry for one card at one latent token grid."""

    card: str = ANY_CARD  # card id, or "*" for every card
    grid: Dims | None = None  # token grid (frames, height, width) after patching; None: any grid
    tile: Dims = DEFAULT_TILE  # tokens per tile along (t, h, w)
    window: Dims = DEFAULT_WINDOW  # tiles each query tile attends to along (t, h, w)
    block_size: int | None = Field(None, ge=1)  # flex kernel block; None: one block per tile

    @model_validator(mode="after")
    def _fits(self) -> StaWindow:
        if self.grid is not None:
            TileLayout(self.grid, self.tile, self.window)  # raises when the window leaves the grid
        volume = self.tile[0] * self.tile[1] * self.tile[2]
        if self.block_size is not None and volume % self.block_size:
            raise ValueError(
                f"block_size {self.block_size} must divide the tile volume {volume} (tile {self.tile}). "
                "Fix: choose a divisor of the tile volume or leave block_size unset."
            )
        return self


class StaOptions(Strict):
    """Options of plugin fv-sta."""

    windows: list[StaWindow] = Field(default_factory=list)  # first match wins; exact grid before any grid
    compile: bool = True  # flex path (GPUs) only; False: eager flex (no compile time, much slower)

    def window_for(self, card: str, grid: Dims) -> StaWindow:
        """The configured geometry for ``card`` at ``grid``; the defaults, clamped to the grid, if none."""
        ranked = sorted(self.windows, key=lambda w: (w.grid is None, w.card == ANY_CARD))
        for entry in ranked:
            if entry.card in (card, ANY_CARD) and entry.grid in (tuple(grid), None):
                return entry
        tiles = [-(-n // t) for n, t in zip(grid, DEFAULT_TILE, strict=True)]
        window = tuple(min(w, n) for w, n in zip(DEFAULT_WINDOW, tiles, strict=True))
        return StaWindow(card=card, grid=tuple(grid), window=window)  # type: ignore[arg-type]
