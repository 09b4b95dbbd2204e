"""The STA attention kernels registered for ``("attention", ..., "sta")``.

All take the core attention signature plus the token ``grid`` (and the ``card``
id, to pick the configured window); inputs and output are ``[B, heads, T*H*W, D]``
in grid order. ``tile``/``window``/``block_size`` override the options.
``path`` says, before running, which implementation a call uses and why.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from dataclasses import dataclass
from typing import Any, Self

import torch

from fv_sta.flex import flex_sta
from fv_sta.gather import gather_sta
from fv_sta.options import ANY_CARD, StaOptions, StaWindow
from fv_sta.tiles import Dims, TileLayout, from_tiles, to_tiles

# What the st-attn (ThunderKittens, Hopper) kernel accepts: its fixed tile and token grids.
ST_ATTN_TILE: Dims = (6, 8, 8)
ST_ATTN_GRIDS: frozenset[Dims] = frozenset({(30, 48, 80), (36, 48, 48), (18, 48, 80)})


@dataclass(frozen=True, slots=True)
class KernelPath:
    """The implementation one call runs, for provenance."""

    name: str  # "gather" (CPU), "flex" (compiled flex_attention), "flex-eager" or "st-attn"
    geometry: StaWindow  # grid, tile, window and block size used
    reason: str | None = None  # why a faster path was not taken; None when nothing was refused

    def record(self) -> dict[str, Any]:
        g = self.geometry
        return {
            "path": self.name,
            "grid": g.grid,
            "tile": g.tile,
            "window": g.window,
            "block_size": g.block_size,
            "fallback_reason": self.reason,
        }


def _check_call(attn_mask: torch.Tensor | None, is_causal: bool, query: torch.Tensor, grid: Dims) -> None:
    if attn_mask is not None or is_causal:
        raise ValueError(
            "STA attention takes no attn_mask or is_causal: the tile window is its mask. "
            "Fix: use the 'sdpa' kernel for masked or causal attention."
        )
    tokens = grid[0] * grid[1] * grid[2]
    if query.shape[-2] != tokens:
        raise ValueError(
            f"STA got {query.shape[-2]} tokens but grid {tuple(grid)} has {tokens}. "
            "Fix: pass the latent token grid (frames, height, width) after patching."
        )


@dataclass(frozen=True)
class _StaKernel:
    """What the STA kernels share: options, geometry and the tile reordering around ``_attend``."""

    options: StaOptions = StaOptions()

    def with_options(self, options: StaOptions) -> Self:
        return dataclasses.replace(self, options=options)

    def geometry(self, grid: Dims, card: str = ANY_CARD, **override: Any) -> StaWindow:
        """The configured window for ``card`` at ``grid``, with non-None ``override`` fields applied."""
        chosen = self.options.window_for(card, tuple(grid))  # type: ignore[arg-type]
        fields = {k: v for k, v in override.items() if v is not None}
        return StaWindow(**{**chosen.model_dump(), "grid": tuple(grid), **fields})

    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        scale: float | None = None,
        *,
        grid: Dims,
        card: str = ANY_CARD,
        tile: Dims | None = None,
        window: Dims | None = None,
        block_size: int | None = None,
    ) -> torch.Tensor:
        _check_call(attn_mask, is_causal, query, grid)
        g = self.geometry(grid, card, tile=tile, window=window, block_size=block_size)
        layout = TileLayout(tuple(grid), g.tile, g.window)  # type: ignore[arg-type]
        q, k, v = (to_tiles(t, layout) for t in (query, key, value))
        return from_tiles(self._attend(q, k, v, layout, g, scale), layout)

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layout: TileLayout,
        g: StaWindow,
        scale: float | None,
    ) -> torch.Tensor:
        raise NotImplementedError


@dataclass(frozen=True)
class StaFlex(_StaKernel):
    """STA on ``flex_attention`` (compiled unless the options say otherwise): any device."""

    def path(self, query: torch.Tensor, geometry: StaWindow, scale: float | None = None) -> KernelPath:
        return KernelPath("flex" if self.options.compile else "flex-eager", geometry)

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layout: TileLayout,
        g: StaWindow,
        scale: float | None,
    ) -> torch.Tensor:
        return flex_sta(q, k, v, layout, g.block_size or layout.tile_volume, scale, self.options.compile)


@dataclass(frozen=True)
class StaGather(_StaKernel):
    """STA as SDPA over each query tile's gathered window: the CPU kernel (no compile, no block mask)."""

    def path(self, query: torch.Tensor, geometry: StaWindow, scale: float | None = None) -> KernelPath:
        return KernelPath("gather", geometry)

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layout: TileLayout,
        g: StaWindow,
        scale: float | None,
    ) -> torch.Tensor:
        return gather_sta(q, k, v, layout, scale)


@dataclass(frozen=True)
class StaHopper(StaFlex):
    """The st-attn Hopper kernel where its shapes fit, else the flex path with the reason recorded."""

    def path(self, query: torch.Tensor, geometry: StaWindow, scale: float | None = None) -> KernelPath:
        reason = _st_attn_refusal(query, geometry, scale)
        if reason is None:
            return KernelPath("st-attn", geometry)
        return dataclasses.replace(super().path(query, geometry), reason=reason)

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layout: TileLayout,
        g: StaWindow,
        scale: float | None,
    ) -> torch.Tensor:
        if _st_attn_refusal(q, g, scale) is not None:
            return super()._attend(q, k, v, layout, g, scale)
        st_attn = importlib.import_module("st_attn")
        windows = [list(g.window)] * q.shape[1]  # one window per head
        return st_attn.sliding_tile_attention(q, k, v, windows, 0, False, "x".join(map(str, layout.grid)))


def _st_attn_refusal(query: torch.Tensor, geometry: StaWindow, scale: float | None) -> str | None:
    """Why st-attn cannot run this call, or None when it can."""
    if importlib.util.find_spec("st_attn") is None:
        return "st_attn is not installed (pip install st_attn)"
    if query.device.type != "cuda" or torch.cuda.get_device_capability(query.device) != (9, 0):
        return f"st-attn needs a Hopper (sm90) GPU; tensors are on {query.device}"
    if query.dtype not in (torch.bfloat16, torch.float16):
        return f"st-attn needs bf16/fp16; got {query.dtype}"
    if geometry.tile != ST_ATTN_TILE or geometry.grid not in ST_ATTN_GRIDS:
        return (
            f"st-attn supports tile {ST_ATTN_TILE} on grids {sorted(ST_ATTN_GRIDS)}; "
            f"got tile {geometry.tile} on grid {geometry.grid}"
        )
    if scale not in (None, query.shape[-1] ** -0.5):
        return f"st-attn uses the default scale 1/sqrt(head_dim); got scale {scale}"
    return None


sta_flex = StaFlex()
sta_gather = StaGather()
sta_hopper = StaHopper()
