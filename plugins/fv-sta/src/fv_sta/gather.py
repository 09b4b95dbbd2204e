"""STA by gathering each window's key tiles once and running SDPA on them: the CPU path.

With edge clamping, query tiles near a grid edge share one window (the same key
tiles): on a grid of ``n`` tiles per axis there are only ``n - w + 1`` distinct
windows along it. Query tiles are grouped by window, so the ``prod(window)`` key
and value tiles of a window are copied once for all its query tiles, and windows
holding the same number of query tiles stack into one ``[B, heads*windows,
window tokens, D]`` SDPA call. Compute is exactly the kept blocks, run by
PyTorch's fused CPU attention kernel. Padded key tokens (grids that do not
divide into tiles) get a ``-inf`` bias; grids that divide need no mask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F

from fv_sta.tiles import TileLayout, real_tokens, tile_neighbours

CHUNK_BYTES = 256 * 2**20  # gathered keys + values per SDPA call


@dataclass(frozen=True, slots=True)
class WindowGroup:
    """Windows that each serve the same number of query tiles."""

    queries: torch.Tensor  # [windows, query tiles per window] query tile ids
    keys: torch.Tensor  # [windows, prod(window)] key tile ids
    bias: torch.Tensor | None  # [windows, window tokens] -inf on padded keys; None without padding


@lru_cache(maxsize=64)
def window_groups(layout: TileLayout, device: str) -> tuple[WindowGroup, ...]:
    """The distinct windows of ``layout``, grouped by how many query tiles share each."""
    neighbours = tile_neighbours(layout)
    windows, owner = torch.unique(neighbours, dim=0, return_inverse=True)
    real = real_tokens(layout).reshape(layout.num_tiles, layout.tile_volume)
    shared = torch.bincount(owner, minlength=len(windows))
    groups = []
    for count in shared.unique().tolist():
        ids = (shared == count).nonzero().flatten()
        queries = torch.stack([(owner == i).nonzero().flatten() for i in ids.tolist()])
        keys = windows[ids]
        bias = None
        if not bool(real.all()):
            visible = real[keys].flatten(1)
            bias = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf")).to(device)
        groups.append(WindowGroup(queries.to(device), keys.to(device), bias))
    return tuple(groups)


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
    q, k, v = (t.reshape(batch, heads, tiles, volume, dim) for t in (query, key, value))
    out = torch.empty_like(q)
    window_len = volume * math.prod(layout.window)
    per_window = batch * heads * window_len * dim  # elements of one window's keys
    chunk = max(1, CHUNK_BYTES // (2 * per_window * key.element_size()))
    # One buffer per operand, reused by every chunk: fresh large allocations cost page faults
    # that take longer than the copy itself.
    k_buf, v_buf = (t.new_empty(min(chunk, tiles) * per_window) for t in (key, value))
    for group in window_groups(layout, str(query.device)):
        shared = group.queries.shape[1]
        for start in range(0, len(group.keys), chunk):
            ids = slice(start, start + chunk)
            rows, keys = group.queries[ids].flatten(), group.keys[ids].flatten()
            n = len(rows) // shared  # windows in this call

            def window(t: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
                dest = buf[: n * per_window].view(batch, heads, len(keys), volume, dim)  # noqa: B023
                torch.index_select(t, 2, keys, out=dest)  # noqa: B023
                return dest.view(batch, heads * n, window_len, dim)  # noqa: B023

            mask = None
            if group.bias is not None:  # [1, heads * n, 1, window_len], one row per window
                mask = group.bias[ids].expand(heads, n, window_len).reshape(1, heads * n, 1, window_len)
            part = F.scaled_dot_product_attention(
                q.index_select(2, rows).view(batch, heads * n, shared * volume, dim),
                window(k, k_buf),
                window(v, v_buf),
                mask,
                scale=scale,
            )
            out.index_copy_(2, rows, part.view(batch, heads, len(rows), volume, dim))
    return out.reshape(batch, heads, tiles * volume, dim)
