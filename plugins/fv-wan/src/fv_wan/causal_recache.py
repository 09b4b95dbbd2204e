"""KV re-cache on a prompt change (LongLive's technique) for causal Wan sessions.

A cached frame's keys/values were made by a pass that cross-attended to the text of the request that
wrote it, so a session continued under a new prompt keeps reading the old one through its context.
With ``recache_on_prompt_change``, a continuation whose text (:func:`text_tag`) differs from the one
the session's cache attended to first re-runs the window's frames, from the clean latents the session
keeps, at the context timestep under its own text: one AR_PREFILL pass per block of frames
(:func:`blocks`, oldest first, each over the blocks re-cached before it), into a fresh sequence of
the KV pool that then replaces the session's. The frames, their positions and the window are unchanged;
only what their keys/values attended to is new. Without a text change nothing runs.
"""

from __future__ import annotations

from typing import Any

from fv_core.kv import KVSeq, PagedKVPool
from fv_core.loop import LoopState
from fv_wan.samplers import renoise


def text_tag(params: Any) -> tuple:
    """The text a request's chunks attend to: its prompt, and what steering blends into it."""
    if params.steer_from is not None and params.steer_strength < 1:
        return (params.prompt, params.steer_from, params.steer_strength)
    return (params.prompt,)


def blocks(frames: list[int], chunk_frames: int) -> list[list[int]]:
    """``[start, end)`` index runs of ``frames`` that are consecutive and of one chunk (what one pass
    re-runs), in order."""
    out: list[list[int]] = []
    for i, f in enumerate(frames):
        if out and frames[i - 1] == f - 1 and frames[i - 1] // chunk_frames == f // chunk_frames:
            out[-1][1] = i + 1
        else:
            out.append([i, i + 1])
    return out


def start(state: LoopState, session: Any, params: Any) -> None:
    """Set the passes up when the request asks for a re-cache and its text is not the session's cache's."""
    v = state.values
    if not params.recache_on_prompt_change or session.latents is None or session.text == text_tag(params):
        return
    v["recache"] = blocks(session.cache_frames, v["chunk_frames"])  # passes left
    v["recache_seq"] = {"pages": [], "length": 0}  # the keys/values re-made so far
    v["recached_frames"] = len(session.cache_frames)
    state.tensors["recache_x"] = renoise(session.latents, v["context_sigma"], state.generator)


def pass_inputs(state: LoopState) -> dict[str, Any]:
    """The next pass's block: its latents at the context timestep, first frame, context (the blocks
    re-cached before it) and label."""
    v, (a, b) = state.values, state.values["recache"][0]
    frames = v["cache_frames"]
    return dict(
        latents=state.tensors["recache_x"][:, :, a:b],
        timestep=v["context_sigma"] * v["train_steps"],
        start=frames[a],
        seq=KVSeq(**v["recache_seq"]),
        frames=frames[:a],
        label=f"re-cache frames {frames[a]}..{frames[b - 1]}",
    )


def fold(pool: PagedKVPool, state: LoopState, out: dict[str, Any]) -> None:
    """Append the pass's keys/values; after the last, the fresh sequence replaces the request's fork
    of the session's."""
    v = state.values
    seq = pool.append(KVSeq(**v["recache_seq"]), out["k"][0], out["v"][0])
    v["recache"].pop(0)
    state.step += 1
    if v["recache"]:
        v["recache_seq"] = {"pages": list(seq.pages), "length": seq.length}
        return
    pool.release(KVSeq(**v["seq"]))
    v["seq"] = {"pages": list(seq.pages), "length": seq.length}
    del v["recache_seq"], state.tensors["recache_x"]


def release(pool: PagedKVPool, state: LoopState) -> None:
    """Return the pages of an unfinished re-cache (the request was cancelled or failed)."""
    seq = state.values.pop("recache_seq", None)
    if seq and seq["pages"]:
        pool.release(KVSeq(**seq))
