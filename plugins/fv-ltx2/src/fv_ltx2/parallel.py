"""LTX-2's guidance-branch calls on a parallel group: rows over the cfg ranks, tokens over Ulysses.

Each guidance branch of a step is its own WorkUnit (``cfg`` with rows [uncond, cond] per request,
``cond`` / ``stg`` / ``modality`` with one row per request), so a group step is one transformer call.
When the call has at least as many rows as there are cfg ranks, cfg rank ``c`` takes rows ``c, c + cfg,
...`` (the ``cfg`` branch: the uncond rows on rank 0, the cond rows on rank 1, as Wan's batched CFG);
a one-row call (the ``stg`` and ``modality`` branches of one request) runs on cfg rank 0 and the other
cfg ranks sit it out: a row cannot be split, and the next WorkUnit is not known before this one ends.
Inside a call :func:`fv_ltx2.transformer.forward_blocks` shards the video and the audio tokens and
:mod:`fv_ltx2.attention` swaps to head shards around every attention that spans a stream. Sequence rank 0
of each working cfg rank returns its rows; rank 0 interleaves them back into the call's row order, so
the loop cannot tell the difference.
"""

from __future__ import annotations

from typing import Any

from fv_core.extend import BLOCKS_INPUT
from fv_core.parallel import ParallelGroup, current, running_as
from fv_ltx2.attention import install
from fv_ltx2.transformer import forward_blocks

STEP_FN = "fv_ltx2.parallel:denoise_shard"
# a request's text embeddings, text mask and positions: the same tensors at every step
RESIDENT = ("video_text", "audio_text", "text_mask", "video_coords", "audio_coords")
ROWS = ("latents", "audio_latents", "video_text", "audio_text", "text_mask", "timestep", "audio_timestep")
ROWS += ("video_coords", "audio_coords")  # inputs whose first dimension is the call's rows


def denoise_shard(transformer, inputs: dict[str, Any]) -> dict[str, Any] | None:
    """This rank's part of one branch call (every rank of the group runs it at once)."""
    rank = current()
    assert rank is not None, "a parallel step runs inside ParallelGroup.run"
    cfg = rank.plan.cfg
    split = cfg > 1 and inputs["latents"].shape[0] >= cfg  # rows over the cfg ranks
    if not split and rank.cfg_index:
        return None  # a call of fewer rows than cfg ranks: cfg rank 0's
    if rank.sp > 1:
        install(transformer)
    mine = {k: v[rank.cfg_index :: cfg] if split and k in ROWS else v for k, v in inputs.items()}
    with running_as(rank.forward(rows_split=split)):
        branch = current().branch(inputs["branch"], rows_split=split)
        video, audio = forward_blocks(transformer, inputs.get(BLOCKS_INPUT), branch, mine, inputs["statics"])
    return {"video": video.float(), "audio": audio.float()} if rank.sp_index == 0 else None


def parallel_denoise_body(
    group: ParallelGroup, statics: dict[str, Any], branch: str, inputs: dict[str, Any]
) -> dict[str, Any]:
    """Rank 0's body of one branch call: run it on the group, then the outputs ``denoise_body`` gives."""
    sent = {**inputs, "statics": statics, "branch": branch}
    replies = group.run(STEP_FN, "transformer", sent, label=f"denoise ({branch})", resident=RESIDENT)
    parts = [reply.outputs for reply in replies if reply.outputs]  # cfg rank order
    if len(parts) == 1:
        return parts[0]
    rows, out = inputs["latents"].shape[0], {}
    for name in ("video", "audio"):
        whole = parts[0][name].new_empty((rows, *parts[0][name].shape[1:]))
        for c, part in enumerate(parts):
            whole[c :: len(parts)] = part[name]
        out[name] = whole
    return out
