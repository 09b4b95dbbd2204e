"""The reference causal Wan is tested against (the causal cards' parity reference): the same causal
model computed by full recompute, no cache. Each chunk's velocity comes from every earlier chunk (at the
context timestep) and itself run together from the patch embedding up, each chunk's tokens seeing the
frames its rolling window held (a block mask); noise is drawn in the cached loop's order."""

from __future__ import annotations

import torch

from fv_wan.causal_transformer import causal_forward
from fv_wan.causal_window import window_after
from fv_wan.params import CausalWanParams
from fv_wan.samplers import chunk_schedule, renoise, shifted


def recompute_velocity(
    model,
    context: list[torch.Tensor],
    latents: torch.Tensor,
    t: float,
    context_t: float,
    kv: torch.Tensor,
    window: int,
    sink: int,
) -> torch.Tensor:
    """The velocity of chunk ``len(context)`` (``latents`` at ``t``) computed without a cache: every
    earlier chunk (``context``, each at ``context_t``) and this one run together from the patch
    embedding up, each chunk's tokens seeing the frames its rolling window held (a block mask)."""
    n = latents.shape[2]
    chunks = [*context, latents]
    full = torch.cat(chunks, 2)
    _, _, frames, height, width = full.shape
    _, p_h, p_w = model.config.patch_size
    tpf = (height // p_h) * (width // p_w)
    see = torch.zeros(frames, frames, dtype=torch.bool)
    for c in range(len(chunks)):
        visible = window_after(c, n, window, sink) + list(range(c * n, (c + 1) * n))
        see[c * n : (c + 1) * n, visible] = True
    mask = see.repeat_interleave(tpf, 0).repeat_interleave(tpf, 1)[None, None].to(full.device)
    steps = torch.full((1, frames * tpf), context_t, dtype=torch.float32)
    steps[:, (frames - n) * tpf :] = t
    rope = model.rope(full)
    empty = full.new_zeros(
        1, len(model.blocks), model.config.num_attention_heads, 0, model.config.attention_head_dim
    )
    out = causal_forward(model, full.to(kv.dtype), steps.to(full.device), kv, rope, empty, empty, mask)
    return out["velocity"][:, :, frames - n :]


def recompute_generate(
    model,
    kv: torch.Tensor,
    noise: torch.Tensor,
    params: CausalWanParams,
    fixed: list[int],
    generator: torch.Generator,
) -> torch.Tensor:
    """The causal model's video latents by full recompute (no cache), drawing noise from ``generator`` in
    the loop's order: the reference the cached loop must equal."""
    timesteps, sigmas = chunk_schedule(fixed, params.flow_shift)
    ctx_sigma = shifted(params.context_timestep, params.flow_shift)
    n = params.chunk_frames
    done: list[torch.Tensor] = []
    context: list[torch.Tensor] = []  # every written chunk at the context timestep
    chunks = noise.shape[2] // n
    for c in range(chunks):
        x = noise[:, :, c * n : (c + 1) * n]
        for i in range(len(fixed)):
            v = recompute_velocity(
                model,
                context,
                x,
                float(timesteps[i]),
                ctx_sigma * 1000,
                kv,
                params.window_frames,
                params.sink_frames,
            )
            x = renoise(x - sigmas[i] * v.float(), float(sigmas[i + 1]), generator)
        done.append(x)
        if c < chunks - 1:
            context.append(renoise(x, ctx_sigma, generator))
    return torch.cat(done, 2)
