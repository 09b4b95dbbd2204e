"""STA on ``flex_attention``: a block mask built straight from tile adjacency.

``create_block_mask`` would evaluate a mask function over every (query, key)
pair, far too slow on CPU at 32k tokens. The tile window already says which key
blocks each query block sees, so the block lists are written down directly:
blocks without padding are "full" (no per-token mask), blocks holding padding
are "partial" and get a mask that hides the padded keys. The mask function
states the whole STA rule (tile adjacency and real keys), so eager flex, which
applies it everywhere, computes the same attention.

Shapes are bucketed so a new sequence length does not recompile: the tile-major
sequence is padded up to a power-of-two number of tiles, and every tensor the
compiled kernel sees (q/k/v, block lists, the mask's lookup tables) has the
bucket's shape. Padding tiles have no key blocks (the kernel skips them at no
cost) and no real query sees them; their rows are dropped after the call.
Dynamo keeps at most ``recompile_limit`` graphs of ``flex_attention``; past it,
flex silently runs unfused and materializes every score (gigabytes at 16k
tokens), so a shape that would need one more graph runs the gather kernel
instead (same result), with a warning.
"""

from __future__ import annotations

import warnings
from functools import cache, lru_cache
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from fv_sta.gather import gather_sta
from fv_sta.tiles import TileLayout, real_tokens, tile_neighbours


def _split_full_partial(kv_blocks: torch.Tensor, padded: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per query block: (num, indices) of full key blocks, then of partial ones, each ``[1, 1, ...]``.

    ``padded`` covers the bucket's key blocks; query blocks past ``kv_blocks``' rows get no key blocks."""
    is_partial = padded[kv_blocks].to(torch.int8)
    counts = (is_partial.sum(1), (1 - is_partial).sum(1))
    order = torch.argsort(is_partial, dim=1, stable=True)  # full blocks first
    full = kv_blocks.gather(1, order)
    partial = kv_blocks.gather(1, order.flip(1))  # partial blocks first
    blocks = padded.numel()  # rows padded to the bucket and to all key blocks; past a count: ignored
    rows = blocks - kv_blocks.shape[0]
    pad = lambda t: F.pad(t, (0, blocks - t.shape[1], 0, rows))  # noqa: E731
    as_mask = lambda t: t.to(torch.int32)[None, None].contiguous()  # noqa: E731
    num = lambda t: as_mask(F.pad(t, (0, rows)))  # noqa: E731
    return num(counts[1]), as_mask(pad(full)), num(counts[0]), as_mask(pad(partial))


def bucket_tiles(num_tiles: int) -> int:
    """Tiles in the shape bucket holding ``num_tiles``: the next power of two."""
    return 1 << (num_tiles - 1).bit_length()


@lru_cache(maxsize=64)
def sta_block_mask(layout: TileLayout, block_size: int, device: str) -> BlockMask:
    """The block mask of ``layout`` in tile-major order, padded to its bucket; cached per
    (grid, tile, window, block, device)."""
    if layout.tile_volume % block_size:
        raise ValueError(
            f"STA block size {block_size} must divide the tile volume {layout.tile_volume} "
            f"(tile {layout.tile}). Fix: pick a block size that divides it, or another tile."
        )
    split = layout.tile_volume // block_size  # blocks per tile
    neighbours = tile_neighbours(layout)  # [tiles, window tiles]
    kv_blocks = (neighbours[:, :, None] * split + torch.arange(split)).reshape(len(neighbours), -1)
    kv_blocks = kv_blocks.repeat_interleave(split, dim=0)  # every block of a query tile sees the same keys
    tiles = bucket_tiles(layout.num_tiles)
    real = F.pad(real_tokens(layout), (0, (tiles - layout.num_tiles) * layout.tile_volume))
    padded = ~real.reshape(-1, block_size).all(1)
    full_num, full_idx, part_num, part_idx = (t.to(device) for t in _split_full_partial(kv_blocks, padded))
    adjacent = torch.zeros(tiles, tiles, dtype=torch.bool)
    adjacent[: layout.num_tiles].scatter_(1, neighbours, True)
    adjacent, real, volume = adjacent.to(device), real.to(device), layout.tile_volume

    def sta_rule(b: Any, h: Any, q: Any, kv: Any) -> Any:
        return adjacent[q // volume, kv // volume] & real[kv]

    return BlockMask.from_kv_blocks(
        part_num,
        part_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=block_size,
        mask_mod=sta_rule,
        seq_lengths=(len(real), len(real)),
    )


@cache
def _compiled_flex() -> Any:
    return torch.compile(flex_attention, dynamic=False)


_COMPILED_SHAPES: set[tuple] = (
    set()
)  # shapes compiled flex has graphs for (one per bucket, batch, heads, ...)


def _within_compile_limit(q: torch.Tensor, mask: BlockMask) -> bool:
    """Whether compiled flex has, or may add, a graph for this call's shapes."""
    key = (tuple(q.shape[:2]), q.shape[-1], mask.seq_lengths, mask.BLOCK_SIZE, q.dtype, q.device)
    if key in _COMPILED_SHAPES:
        return True
    if len(_COMPILED_SHAPES) >= torch._dynamo.config.recompile_limit:
        warnings.warn(
            f"STA: compiled flex already holds {len(_COMPILED_SHAPES)} shapes (dynamo's recompile_limit); "
            f"shape {key} runs the gather kernel. Fix: fewer distinct (batch, heads, bucket) shapes, or "
            "raise torch._dynamo.config.recompile_limit.",
            stacklevel=3,
        )
        return False
    _COMPILED_SHAPES.add(key)
    return True


def flex_sta(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: TileLayout,
    block_size: int,
    scale: float | None = None,
    compiled: bool = True,
) -> torch.Tensor:
    """Attention over tile-major ``[B, heads, padded_len, D]`` tensors within the tile window."""
    mask = sta_block_mask(layout, block_size, str(query.device))
    if compiled and not _within_compile_limit(query, mask):
        return gather_sta(query, key, value, layout, scale)
    attend = _compiled_flex() if compiled else flex_attention
    extra = mask.seq_lengths[0] - layout.padded_len
    q, k, v = (F.pad(t, (0, 0, 0, extra)) for t in (query, key, value))
    return attend(q, k, v, block_mask=mask, scale=scale)[:, :, : layout.padded_len]
