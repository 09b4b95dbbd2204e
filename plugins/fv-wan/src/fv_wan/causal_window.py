"""Causal Wan's rolling window of cached latent frames, and how its chunk passes read the KV pool.

A chunk's keys/values are written into the request's sequence of the paged KV pool once it is clean.
The window holds at most ``window_frames`` latent frames: before a chunk is written, the oldest frames
after the first ``sink_frames`` (the attention sinks) are dropped (:func:`evict`, or whole blocks a KV
policy picks: :func:`policy_evict`), whole pages when they fill whole pages (:func:`drop_tokens`). A
chunk pass gathers its context padded to a power-of-two number of frames (:func:`context_frames`) and
tells a KV policy the cache's layout (:func:`cache_layout`).
"""

from __future__ import annotations

import torch

from fv_core.kv import KVSeq, PagedKVPool


def evict(frames: list[int], incoming: int, window: int, sink: int) -> tuple[list[int], list[int]]:
    """Frames the cache keeps (and drops) to make room for ``incoming`` frames under ``window``: the
    oldest ones after the first ``sink``."""
    over = len(frames) + incoming - window
    if over <= 0:
        return list(frames), []
    return frames[:sink] + frames[sink + over :], frames[sink : sink + over]


def window_after(chunk: int, chunk_frames: int, window: int, sink: int) -> list[int]:
    """The latent frames in the cache while chunk ``chunk`` runs (chunks before it written in order)."""
    frames: list[int] = []
    for j in range(chunk):
        frames = evict(frames, chunk_frames, window, sink)[0] + list(
            range(j * chunk_frames, (j + 1) * chunk_frames)
        )
    return frames


def drop_tokens(pool: PagedKVPool, seq: KVSeq, start: int, end: int) -> KVSeq:
    """``seq`` without its tokens ``start:end``: whole pages go back to the pool when both ends fall on
    page boundaries; otherwise the kept tokens are copied into a fresh sequence."""
    page = pool.page_size
    if start % page == 0 and end % page == 0:
        a, b = start // page, end // page
        pool.release(KVSeq(seq.pages[a:b], end - start))
        return KVSeq(seq.pages[:a] + seq.pages[b:], seq.length - (end - start))
    k, v = pool.read(seq)
    keep_k = torch.cat([k[:, :, :start], k[:, :, end:]], 2)
    keep_v = torch.cat([v[:, :, :start], v[:, :, end:]], 2)
    pool.release(seq)
    return pool.append(KVSeq(), keep_k, keep_v)


def context_frames(cached: int, window: int) -> int:
    """Frames a chunk pass's context is padded to: the next power of two of ``cached`` (at most the
    window), so contexts of nearby lengths share a batch key; 0 for an empty cache."""
    if cached == 0:
        return 0
    size = 1
    while size < cached:
        size *= 2
    return min(size, window)


def cache_layout(
    frames: list[int], chunk_frames: int, sink: int, tokens_per_frame: int, size: int, room: int, device
) -> dict[str, torch.Tensor]:
    """The cache's blocks as a KV policy reads them (one row on ``device``; ``fv_core.extend.KVPolicy``):
    the slot of each of the ``size`` context tokens, each slot's block index, frames and sink flag, and
    ``room``."""
    slots = size // tokens_per_frame
    blocks: list[int] = []
    counts: list[int] = []
    for f in frames:
        if not blocks or blocks[-1] != f // chunk_frames:
            blocks.append(f // chunk_frames)
            counts.append(0)
        counts[-1] += 1
    of_token = [i for i, c in enumerate(counts) for _ in range(c * tokens_per_frame)]
    pad = slots - len(blocks)
    rows = {
        "kv_slots": [of_token + [-1] * (size - len(of_token))],
        "kv_blocks": [blocks + [-1] * pad],
        "kv_frames": [counts + [0] * pad],
        "kv_sinks": [[b * chunk_frames < sink for b in blocks] + [False] * pad],
        "kv_room": [room],
    }
    kinds = {"kv_sinks": torch.bool}
    return {
        name: torch.tensor(row, dtype=kinds.get(name, torch.long), device=device)
        for name, row in rows.items()
    }


def policy_evict(
    frames: list[int], chunk_frames: int, window: int, blocks: list[int]
) -> tuple[list[int], list[int]]:
    """The frames kept and dropped when a KV policy evicts ``blocks`` (of ``chunk_frames`` frames each);
    it must leave room for a chunk under ``window``."""
    dropped = [f for f in frames if f // chunk_frames in blocks]
    kept = [f for f in frames if f // chunk_frames not in blocks]
    if len(kept) + chunk_frames > window:
        raise RuntimeError(
            f"the KV policy evicted blocks {blocks}, leaving {len(kept)} cached latent frames: with {chunk_frames} more "
            f"they pass the budget of window_frames={window}. A KV policy must evict down to the budget."
        )
    return kept, dropped


def runs(indices: list[int]) -> list[tuple[int, int]]:
    """Sorted ``indices`` as contiguous ``[start, end)`` runs."""
    out: list[tuple[int, int]] = []
    for i in indices:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out
