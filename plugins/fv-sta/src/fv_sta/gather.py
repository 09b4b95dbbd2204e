"""STA by gathering each query tile's window and running SDPA on it: the CPU path.

With edge clamping every query tile sees the same number of key tiles, so the
windows of a chunk of query tiles stack into one ``[B, heads*chunk, window
tokens, D]`` key tensor and one SDPA call covers the chunk. Compute is exactly
the kept blocks (no per-block mask evaluation), run by PyTorch's fused CPU
attention kernel; the gather copies ``prod(window)`` key/value tiles per query
tile. Padded key tokens (grids that do not divide into tiles) get a ``-inf``
bias; grids that divide need no mask at all.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F

from fv_sta.tiles import TileLayout, real_tokens, tile_neighbours

CHUNK_BYTES = 256 * 2**20  # gathered keys + values per SDPA call


@lru_cache(maxsize=64)
def _window_bias(layout: TileLayout, device: str) -> torch.Tensor | None:
    """``[num_tiles, window tokens]`` additive bias hiding padded keys; None without padding."""
    real = real_tokens(layout)
    if bool(real.all()):
        return None
    keys = real.reshape(layout.num_tiles, layout.tile_volume)[tile_neighbours(layout)].flatten(1)
    bias = torch.zeros(keys.shape).masked_fill_(~keys, float("-inf"))
    return bias.to(device)


@lru_cache(maxsize=64)
def _neighbours(layout: TileLayout, device: str) -> torch.Tensor:
    return tile_neighbours(layout).to(device)


def gather_sta(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: TileLayout,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention over tile-major ``[B, heads, padded_len, D]`` tensors within the tile window."""
    batch, heads, _, dim = query.shape
    tiles, volume = layout.num_tiles, layout.tile_volume
    device = str(query.device)
    neighbours, bias = _neighbours(layout, device), _window_bias(layout, device)
    window_len = neighbours.shape[1] * volume
    q, k, v = (t.reshape(batch, heads, tiles, volume, dim) for t in (query, key, value))
    per_tile = batch * heads * window_len * dim
    chunk = max(1, min(tiles, CHUNK_BYTES // (2 * per_tile * key.element_size())))
    # One buffer per operand, reused by every chunk: fresh large allocations cost page faults
    # that take longer than the copy itself.
    k_buf, v_buf = (t.new_empty(chunk * per_tile) for t in (key, value))
    out = torch.empty_like(q)
    for start in range(0, tiles, chunk):
        ids = slice(start, min(start + chunk, tiles))
        n = ids.stop - ids.start
        rows = neighbours[ids].flatten()

        def window(t: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
            dest = buf[: n * per_tile].view(batch, heads, len(rows), volume, dim)  # noqa: B023
            torch.index_select(t, 2, rows, out=dest)  # noqa: B023
            return dest.view(batch, heads * n, window_len, dim)  # noqa: B023

        mask = None
        if bias is not None:  # [1, heads * n, 1, window_len], one row per query tile
            mask = bias[ids].expand(heads, n, window_len).reshape(1, heads * n, 1, window_len)
        part = F.scaled_dot_product_attention(
            q[:, :, ids].reshape(batch, heads * n, volume, dim),
            window(k, k_buf),
            window(v, v_buf),
            mask,
            scale=scale,
        )
        out[:, :, ids] = part.view(batch, heads, n, volume, dim)
    return out.reshape(batch, heads, tiles * volume, dim)
