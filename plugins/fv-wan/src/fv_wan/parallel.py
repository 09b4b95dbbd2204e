"""Wan's denoise step on a parallel group: guidance branches over the cfg ranks, tokens over Ulysses.

The step's forwards are listed in a fixed order (:func:`forwards`): two-forward CFG gives ``cond``
then ``uncond``; batched CFG gives one forward over rows ``[cond, uncond]`` per request, which the cfg
ranks split by rows; no CFG gives ``main``. The cfg rank ``c`` runs forwards ``c, c + cfg, ...``; inside
one, :mod:`fv_wan.transformer` shards the tokens and :mod:`fv_wan.attention` swaps to head shards
around self-attention. Sequence rank 0 of each cfg rank returns its outputs; rank 0 puts them back
into the shape :func:`fv_wan.bodies.denoise_body` returns, so the loop cannot tell the difference.
"""

from __future__ import annotations

from typing import Any

import torch

from fv_core.extend import BLOCKS_INPUT
from fv_core.parallel import ParallelGroup, current, running_as
from fv_wan.transformer import wan_forward_kv

STEP_FN = "fv_wan.parallel:denoise_shard"
RESIDENT = ("kv", "neg_kv", "img_kv")  # a request's text / image keys and values: the same every step

# one forward: (output name, branch, kv input, rows of the batch: None = all, else (start, step))
Forward = tuple[str, str, str, tuple[int, int] | None]


def forwards(inputs: dict[str, Any], cfg_degree: int) -> list[Forward]:
    """The forwards of a step, in the order the cfg ranks take them."""
    if "neg_kv" in inputs:
        return [("cond", "cond", "kv", None), ("uncond", "uncond", "neg_kv", None)]
    if inputs.get("batched_cfg") and cfg_degree > 1:  # rows [cond, uncond] per request
        return [(f"velocity.{c}", "main", "kv", (c, 2)) for c in range(2)]
    return [("velocity", "main", "kv", None)]


def denoise_shard(transformer, inputs: dict[str, Any]) -> dict[str, Any] | None:
    """This rank's forwards of one denoise step (every rank of the group runs it at once)."""
    rank = current()
    assert rank is not None, "a parallel step runs inside ParallelGroup.run"
    suffix, img_kv = inputs.get("branch_suffix", ""), inputs.get("img_kv")
    out = {}
    for i, (name, branch, kv_name, rows) in enumerate(forwards(inputs, rank.plan.cfg)):
        if i % rank.plan.cfg != rank.cfg_index:
            continue

        def pick(t: torch.Tensor | None, rows=rows) -> torch.Tensor | None:
            return t if t is None or rows is None else t[rows[0] :: rows[1]]

        with running_as(rank.forward(rows_split=rows is not None)):
            out[name] = wan_forward_kv(
                transformer,
                pick(inputs["latents"]),
                pick(inputs["timestep"]),
                pick(inputs[kv_name]),
                hook=inputs.get(BLOCKS_INPUT),
                branch=current().branch(branch + suffix, rows_split=rows is not None),
                img_kv=pick(img_kv),
            )
    return out if rank.sp_index == 0 else None


def parallel_denoise_body(group: ParallelGroup, expert: str, inputs: dict[str, Any]) -> dict[str, Any]:
    """Rank 0's body of a denoise step: run it on the group, then the outputs ``denoise_body`` gives."""
    replies = group.run(STEP_FN, expert, inputs, label="denoise", resident=RESIDENT)
    parts: dict[str, torch.Tensor] = {}
    for reply in replies:
        parts.update(reply.outputs or {})
    if "velocity.0" in parts:  # batched CFG split by rows: interleave [cond, uncond] back per request
        cond, uncond = parts.pop("velocity.0"), parts.pop("velocity.1")
        parts["velocity"] = torch.stack([cond, uncond], 1).flatten(0, 1)
    return parts
