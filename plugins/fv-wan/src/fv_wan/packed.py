"""Wan requests of different sizes and frame counts as one sequence (a packed call).

Each request's patch embedding, rope, timestep modulation, text cross-attention and output
projection are its own, computed as it would be alone (:mod:`fv_wan.transformer`); the token-wise
parts of every block (norms, projections, feed-forward) run once over all requests' tokens, and
self-attention runs on a ``packed_attention`` kernel that confines each request to its own tokens.
Latents travel flattened, ``[1, C, frames x height x width]`` per request, laid end to end on the
last dim, with each request's latent shape beside them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from fv_core import ConfigError
from fv_wan.attention import rope
from fv_wan.transformer import Prepared, _modulation, block_cross_attention, finish, prepare


@dataclass(slots=True)
class Pack:
    """Everything per token of a packed call, and each request's own inputs."""

    requests: list[Prepared]  # each request's prepare(), as alone
    tokens: list[int]  # each request's patch tokens
    rotary: tuple[torch.Tensor, torch.Tensor]  # rope (cos, sin) of every token, each on its own grid
    cu_seqlens: torch.Tensor  # request boundaries [N + 1]
    kernel: Callable[..., torch.Tensor]  # a packed_attention kernel (fv_core.kernels_packed signature)


def self_attention(attn, x: torch.Tensor, pack: Pack) -> torch.Tensor:
    """``attn1`` (projections, q/k norms, rope as diffusers' WanAttnProcessor) over each request's own
    tokens: the packed kernel on ``[1, heads, tokens, head_dim]``."""
    heads = (attn.heads, -1)
    query = attn.norm_q(attn.to_q(x)).unflatten(2, heads)
    key = attn.norm_k(attn.to_k(x)).unflatten(2, heads)
    value = attn.to_v(x).unflatten(2, heads)
    query, key = rope(query, *pack.rotary), rope(key, *pack.rotary)
    out = pack.kernel(*(t.transpose(1, 2) for t in (query, key, value)), pack.cu_seqlens)
    out = out.transpose(1, 2).flatten(2, 3).type_as(query)
    return attn.to_out[1](attn.to_out[0](out))


def block_forward(block, hidden: torch.Tensor, pack: Pack, index: int) -> torch.Tensor:
    """One WanTransformerBlock on a packed call (the math of :func:`fv_wan.transformer.block_forward`).
    The timestep modulation applies request by request, each segment's tokens broadcasting its own
    [1, 1, dim] vectors as alone (a per-token copy of the six vectors would write and read six times
    the hidden state every block)."""
    mods = [_modulation(block.scale_shift_table, p.modulation) for p in pack.requests]

    def each(fn, *xs: torch.Tensor) -> torch.Tensor:  # fn(request's modulation, its parts of xs)
        parts = zip(mods, *(x.split(pack.tokens, 1) for x in xs), strict=True)
        return torch.cat([fn(m, *x) for m, *x in parts], 1)

    norm = each(lambda m, x: x * (1 + m[1]) + m[0], block.norm1(hidden.float())).type_as(hidden)
    attn = self_attention(block.attn1, norm, pack)
    hidden = each(lambda m, h, a: h + a * m[2], hidden.float(), attn).type_as(hidden)
    norm = block.norm2(hidden.float()).type_as(hidden)
    parts = zip(norm.split(pack.tokens, 1), pack.requests, strict=True)
    hidden = hidden + torch.cat([block_cross_attention(block.attn2, x, p, index) for x, p in parts], 1)
    norm = each(lambda m, x: x * (1 + m[4]) + m[3], block.norm3(hidden.float())).type_as(hidden)
    return each(lambda m, h, f: h + f * m[5], hidden.float(), block.ffn(norm).float()).type_as(hidden)


def wan_forward_packed(
    model,
    latents: list[torch.Tensor],
    timestep: torch.Tensor,
    kv: list[torch.Tensor],
    kernel: Callable[..., torch.Tensor],
    kv_rows: list[torch.Tensor | None] | None = None,
    kv_length: list[int] | None = None,
) -> list[torch.Tensor]:
    """Flow velocity of each request (``latents[i]`` [1, C, F, H, W] at ``timestep[i]``, its own
    ``text_kv`` output ``kv[i]``, folded when ``kv_rows[i]`` is given) from one packed forward; each
    equals :func:`fv_wan.transformer.wan_forward_kv` of the request alone to float rounding."""
    if getattr(kernel, "pads", False):
        raise ConfigError(
            "packed_attention='padded' pads every request to the longest, which Wan's packed forward does not "
            "do. Fix: select 'segments', 'sdpa', 'flex' or (with flash-attn) 'varlen' for Wan."
        )
    n = len(latents)
    rows, lengths = kv_rows or [None] * n, kv_length or [0] * n
    requests = [
        prepare(model, latents[i], timestep[i : i + 1], kv[i], None, rows[i], lengths[i]) for i in range(n)
    ]
    tokens = [p.hidden.shape[1] for p in requests]
    rotary = (torch.cat([p.rotary[0] for p in requests], 1), torch.cat([p.rotary[1] for p in requests], 1))
    cu = torch.nn.functional.pad(torch.tensor(tokens, dtype=torch.int32).cumsum(0, dtype=torch.int32), (1, 0))
    pack = Pack(requests, tokens, rotary, cu, kernel)
    hidden = torch.cat([p.hidden for p in requests], 1)
    for index, block in enumerate(model.blocks):
        hidden = block_forward(block, hidden, pack, index)
    return [finish(model, p, x) for p, x in zip(requests, hidden.split(tokens, 1), strict=True)]
