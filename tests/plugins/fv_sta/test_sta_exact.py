"""STA equals dense SDPA under the equivalent boolean mask, built here independently in grid order."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fv_sta.kernel import StaFlex, StaGather
from fv_sta.options import StaOptions
from fv_sta.tiles import TileLayout, from_tiles, to_tiles

EAGER = StaFlex(StaOptions(compile=False))


def sta_dense_mask(grid, tile, window) -> torch.Tensor:
    """``[L, L]`` bool: key j is visible to query i when, on every axis, j's tile is in i's clamped window."""
    coords = torch.stack(torch.meshgrid(*(torch.arange(n) for n in grid), indexing="ij"), -1).reshape(-1, 3)
    keep = torch.ones(len(coords), len(coords), dtype=torch.bool)
    for axis in range(3):
        tiles = -(-grid[axis] // tile[axis])
        own = coords[:, axis] // tile[axis]
        start = (own - window[axis] // 2).clamp(0, tiles - window[axis])
        keep &= (own[None, :] >= start[:, None]) & (own[None, :] < start[:, None] + window[axis])
    return keep


def qkv(grid, heads=2, dim=16, batch=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tokens = grid[0] * grid[1] * grid[2]
    return [torch.randn(batch, heads, tokens, dim, generator=gen) for _ in range(3)]


CASES = [
    ((4, 8, 8), (2, 4, 4), (1, 1, 1)),  # divides evenly, smallest window
    ((4, 8, 8), (2, 4, 4), (2, 2, 1)),  # even window: clamped, off-centre
    ((5, 7, 9), (2, 4, 4), (2, 1, 2)),  # nothing divides: padded and masked
    ((3, 5, 6), (2, 2, 4), (1, 2, 2)),
    ((1, 9, 10), (1, 4, 4), (1, 3, 1)),  # one frame
]


@pytest.mark.parametrize("kernel", [EAGER, StaGather()], ids=["flex-eager", "gather"])
@pytest.mark.parametrize(("grid", "tile", "window"), CASES)
def test_matches_dense_mask(kernel, grid, tile, window):
    q, k, v = qkv(grid)
    out = kernel(q, k, v, grid=grid, tile=tile, window=window)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=sta_dense_mask(grid, tile, window))
    assert (out - ref).abs().max() <= 1e-5


def test_compiled_matches_dense_mask_with_padding_and_sub_blocks():
    """Compiled flex reads the block lists: full blocks unmasked, padded blocks masked, 2 blocks per tile."""
    grid, tile, window = (5, 7, 9), (2, 4, 4), (2, 1, 2)
    q, k, v = qkv(grid, batch=1)
    out = StaFlex()(q, k, v, grid=grid, tile=tile, window=window, block_size=16)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=sta_dense_mask(grid, tile, window))
    assert (out - ref).abs().max() <= 1e-5


@pytest.mark.parametrize("kernel", [EAGER, StaGather()], ids=["flex-eager", "gather"])
@pytest.mark.parametrize("grid", [(4, 8, 8), (3, 5, 7)])
def test_whole_grid_window_is_dense_attention(kernel, grid):
    tile = (2, 4, 4)
    window = TileLayout(grid, tile, (1, 1, 1)).tiles
    q, k, v = qkv(grid)
    out = kernel(q, k, v, grid=grid, tile=tile, window=window, scale=0.3)
    assert (out - F.scaled_dot_product_attention(q, k, v, scale=0.3)).abs().max() <= 1e-5


def test_tile_reorder_round_trips_and_is_tile_major():
    layout = TileLayout((3, 5, 6), (2, 2, 4), (1, 1, 1))
    x = torch.arange(3 * 5 * 6, dtype=torch.float32).reshape(1, -1, 1)
    tiled = to_tiles(x, layout)
    assert tiled.shape[1] == layout.padded_len == 2 * 3 * 2 * 16
    assert torch.equal(from_tiles(tiled, layout), x)
    # the first tile holds frames 0-1, rows 0-1, columns 0-3
    assert tiled[0, :16, 0].tolist() == [
        t * 30 + h * 6 + w for t in range(2) for h in range(2) for w in range(4)
    ]


def test_window_larger_than_grid_is_rejected():
    with pytest.raises(ValueError, match="exceeds the grid"):
        TileLayout((2, 8, 8), (2, 4, 4), (2, 1, 1))


def test_masked_or_causal_calls_are_rejected():
    q, k, v = qkv((2, 4, 4))
    with pytest.raises(ValueError, match="no attn_mask or is_causal"):
        EAGER(q, k, v, is_causal=True, grid=(2, 4, 4))
    with pytest.raises(ValueError, match="grid"):
        EAGER(q, k, v, grid=(2, 4, 5))


def test_gather_chunks_the_windows_without_changing_the_result(monkeypatch):
    """A small chunk budget splits the 8 windows (2 of one query tile, 4 of two, 2 of four) into calls of
    at most 4 windows."""
    import fv_sta.gather

    grid, tile, window = (5, 7, 9), (2, 4, 4), (2, 1, 2)
    q, k, v = qkv(grid)
    whole = StaGather()(q, k, v, grid=grid, tile=tile, window=window)
    per_tile = 2 * (2 * 2 * 4 * 32 * 16) * 4  # keys + values of one window, batch 2, 2 heads, fp32
    monkeypatch.setattr(fv_sta.gather, "CHUNK_BYTES", 4 * per_tile)
    assert torch.equal(StaGather()(q, k, v, grid=grid, tile=tile, window=window), whole)


def compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def test_compiled_flex_compiles_once_per_shape_bucket():
    """Grids of 12 to 16 tiles (320 to 512 tokens) share the 16-tile bucket: one compile serves them all;
    a 64-tile grid is the next compile. Each call still equals dense attention under the STA mask."""
    import torch._dynamo

    torch._dynamo.reset()
    tile, window = (2, 4, 4), (1, 2, 2)
    before = compiled_graphs()
    for grid in [(5, 8, 8), (7, 8, 8), (4, 16, 8), (2, 12, 16), (5, 8, 8)]:
        q, k, v = qkv(grid, heads=1, dim=8, batch=1)
        out = StaFlex()(q, k, v, grid=grid, tile=tile, window=window)
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=sta_dense_mask(grid, tile, window))
        assert (out - ref).abs().max() <= 1e-5
    assert compiled_graphs() - before == 1
    q, k, v = qkv((8, 16, 16), heads=1, dim=8, batch=1)
    StaFlex()(q, k, v, grid=(8, 16, 16), tile=tile, window=window)
    assert compiled_graphs() - before == 2


def test_shapes_past_the_recompile_limit_run_the_gather_kernel():
    """Past dynamo's recompile_limit flex would run unfused (every score materialized): gather runs instead."""
    import fv_sta.flex

    grid, tile, window = (4, 8, 8), (2, 4, 4), (1, 2, 2)
    q, k, v = qkv(grid, heads=3, dim=8, batch=1)  # a shape no other test compiles
    before = compiled_graphs()
    full = torch._dynamo.config.patch(recompile_limit=len(fv_sta.flex._COMPILED_SHAPES))
    with full, pytest.warns(UserWarning, match="recompile_limit"):
        out = StaFlex()(q, k, v, grid=grid, tile=tile, window=window)
    assert compiled_graphs() == before
    assert torch.equal(out, StaGather()(q, k, v, grid=grid, tile=tile, window=window))
