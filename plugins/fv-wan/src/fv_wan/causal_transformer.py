"""Causal Wan's block-causal transformer: a Wan T2V transformer run over one chunk of latent frames.

A chunk's tokens attend to themselves in full and to the cached keys/values of the chunks before it
that the rolling window still holds (:mod:`fv_wan.causal_window`); cross-attention to the text is Wan's
own. Keys are normalised and rotated with RoPE at the frame's absolute index (:func:`frame_rope`), so a
cached chunk's keys are what a full recompute would compute. :func:`chunk_body` is the one step body of
both a chunk's denoise steps and its cache write (the loop, :mod:`fv_wan.causal_loop`, and the
training adapter run it); the full-recompute reference (:mod:`fv_wan.causal_reference`) runs
:func:`causal_forward` over every chunk at once under a block mask.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from fv_core import ConfigError
from fv_core.extend import KV_INPUT
from fv_wan.transformer import _modulation, block_cross_attention, finish, prepare


def frame_rope(model, start: int, frames: int, height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE (cos, sin) [1, tokens, 1, head_dim] of latent frames ``start .. start+frames`` of a
    ``height`` x ``width`` latent: Wan's rope table at their absolute frame indices."""
    p_t, p_h, p_w = model.config.patch_size
    if start + frames > model.rope.max_seq_len:
        raise ConfigError(
            f"latent frames up to {start + frames}: Wan's rope table has {model.rope.max_seq_len} positions. "
            f"Fix: generate at most {model.rope.max_seq_len} latent frames."
        )
    probe = torch.empty((1, 1, (start + frames) * p_t, height, width), device="meta")  # rope reads the shape
    cos, sin = model.rope(probe)
    skip = start * (height // p_h) * (width // p_w)
    return cos[:, skip:], sin[:, skip:]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` [B, T, H, D] on interleaved pairs (Wan's convention)."""
    even, odd = x.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = even * c - odd * s
    out[..., 1::2] = even * s + odd * c
    return out.type_as(x)


# select(q, ctx_k, ctx_v) -> (ctx_k, ctx_v, mask): the context one layer's queries q [B, H, T, D] attend
# to, chosen by a KV policy from the cached one (and the mask over it and the tokens themselves)
Select = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def self_attention(
    attn, x: torch.Tensor, rope, ctx_k: torch.Tensor, ctx_v: torch.Tensor, mask: torch.Tensor,
    select: Select | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """``attn1`` over the cached keys/values ``ctx_k``/``ctx_v`` [B, H, S, D] and the tokens ``x`` [B, T, dim]
    themselves, ``mask`` [B, 1, T or 1, S + T] True where a query may look (or the context and mask
    ``select`` keeps). Returns the output and the tokens' own keys (normalised, rotated) and values
    [B, H, T, D], what the cache stores."""
    if getattr(attn, "fused_projections", False):
        q, k, v = attn.to_qkv(x).chunk(3, dim=-1)
    else:
        q, k, v = attn.to_q(x), attn.to_k(x), attn.to_v(x)
    q, k = attn.norm_q(q), attn.norm_k(k)
    q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))
    q, k = _rotate(q, *rope), _rotate(k, *rope)
    q, k, v = (t.permute(0, 2, 1, 3) for t in (q, k, v))
    if select is not None:
        ctx_k, ctx_v, mask = select(q, ctx_k, ctx_v)
    keys, values = torch.cat([ctx_k.to(k.dtype), k], 2), torch.cat([ctx_v.to(v.dtype), v], 2)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    out = out.permute(0, 2, 1, 3).flatten(2, 3).type_as(x)
    return attn.to_out[1](attn.to_out[0](out)), k, v


def causal_block(block, hidden: torch.Tensor, prep, index: int, ctx_k, ctx_v, mask, select=None):
    """One WanTransformerBlock with block-causal self-attention; returns hidden and the block's K/V."""
    shift, scale, gate, c_shift, c_scale, c_gate = _modulation(block.scale_shift_table, prep.modulation)
    norm = (block.norm1(hidden.float()) * (1 + scale) + shift).type_as(hidden)
    attn, k, v = self_attention(block.attn1, norm, prep.rotary, ctx_k, ctx_v, mask, select)
    hidden = (hidden.float() + attn * gate).type_as(hidden)
    norm = block.norm2(hidden.float()).type_as(hidden)
    hidden = hidden + block_cross_attention(block.attn2, norm, prep, index)
    norm = (block.norm3(hidden.float()) * (1 + c_scale) + c_shift).type_as(hidden)
    return (hidden.float() + block.ffn(norm).float() * c_gate).type_as(hidden), k, v


def causal_forward(
    model,
    latents: torch.Tensor,
    timestep: torch.Tensor,
    kv: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    ctx_k: torch.Tensor,
    ctx_v: torch.Tensor,
    mask: torch.Tensor,
    select: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None,
    kv_rows: torch.Tensor | None = None,
    kv_length: int = 0,
) -> dict[str, torch.Tensor]:
    """Flow velocity of ``latents`` [B, C, F, H, W] at ``timestep`` ([B] or per token [B, tokens]) given
    text keys/values ``kv`` (folded when ``kv_rows`` gives the positions each row holds of ``kv_length``:
    see ``fv_wan.transformer``), the frames' ``rope`` and every block's cached keys/values
    ``ctx_k``/``ctx_v`` [B, blocks, H, S, D] under ``mask`` (or what ``select(index, q, ctx_k, ctx_v)``
    keeps of them for block ``index``: a KV policy); plus the tokens' own keys/values [B, blocks, H, T, D]."""
    prep = prepare(model, latents, timestep, kv, kv_rows=kv_rows, kv_length=kv_length)
    prep.rotary = rope
    hidden, keys, values = prep.hidden, [], []
    for index, block in enumerate(model.blocks):
        layer = partial(select, index) if select is not None else None
        hidden, k, v = causal_block(block, hidden, prep, index, ctx_k[:, index], ctx_v[:, index], mask, layer)
        keys.append(k)
        values.append(v)
    return {"velocity": finish(model, prep, hidden), "k": torch.stack(keys, 1), "v": torch.stack(values, 1)}


def chunk_body(transformer, inputs: dict[str, Any]) -> dict[str, Any]:
    """One pass of a chunk over its cached context (a denoise step, or the cache write of a clean chunk
        at the context timestep): velocity and the chunk's keys/values. Rows are requests; each row's
        context is padded to the batch's length with ``ctx_valid`` marking its real tokens; text keys/values
    come folded (``kv_rows``, ``kv_length``) from the loop, whole from training. A KV policy
        (``inputs[KV_INPUT]``) picks each layer's context; its statistics join the outputs."""
    latents, valid = inputs["latents"], inputs["ctx_valid"]
    own = torch.ones(valid.shape[0], inputs["rope_cos"].shape[1], dtype=torch.bool, device=valid.device)
    mask = torch.cat([valid, own], 1)[:, None, None, :]
    rope = (inputs["rope_cos"], inputs["rope_sin"])
    policy, select = inputs.get(KV_INPUT), None
    if policy is not None:
        selector = policy.selector(inputs)

        def select(layer: int, q: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor):
            ctx_k, ctx_v, kept = selector(layer, q, ctx_k, ctx_v, valid)
            return ctx_k, ctx_v, torch.cat([kept, own], 1)[:, None, None, :]

    out = causal_forward(
        transformer,
        latents,
        inputs["timestep"],
        inputs["kv"],
        rope,
        inputs["ctx_k"],
        inputs["ctx_v"],
        mask,
        select,
        inputs.get("kv_rows"),
        inputs.get("kv_length", 0),
    )
    return out if policy is None else {**out, **selector.outputs()}
