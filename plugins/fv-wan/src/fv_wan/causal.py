"""Causal Wan: a Wan T2V transformer run chunk by chunk over latent frames (block-causal attention).

The video's latent frames are generated in chunks of ``chunk_frames``. A chunk's tokens attend to
themselves in full and to the keys/values of the chunks before it that the rolling window still
holds; cross-attention to the text is Wan's own. Every block's self-attention keys (normalised and
rotated with RoPE at the frame's absolute index) and values of a finished chunk are written into a
KV cache by one more transformer pass over the clean chunk at the context timestep, so a later
chunk's step computes only its own tokens. The cache holds at most ``window_frames`` frames: before a
chunk is written, the oldest frames after the first ``sink_frames`` (the attention sinks) are dropped.

This module holds the math, shared by the cached path (the loop, :mod:`fv_wan.causal_loop`) and the
full-recompute reference (:func:`recompute_generate`) it is tested against: the rolling window
(:func:`window_after`), the per-frame RoPE (:func:`frame_rope`), the block (:func:`causal_forward`),
the few-step schedule (:func:`chunk_schedule`) and the causal VAE decode (:func:`chunk_decode_body`).
It also holds the card's request parameters (:class:`CausalWanParams`) and the instance with the
paged KV pool (:class:`CausalWanModel`).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import Field

from fv_core import ConfigError, ModelCard
from fv_core.extend import KV_INPUT
from fv_core.kv import KVSeq, PagedKVPool
from fv_wan import conditioning
from fv_wan.model import WanModel
from fv_wan.params import WanParams
from fv_wan.sessions import DEFAULT_TTL_S, Sessions
from fv_wan.transformer import _modulation, cross_attention, finish, prepare

DEFAULT_KV_BYTES = 64 << 20  # the pool's budget when the card's causal_kv cache names none


class CausalWanParams(WanParams):
    """One causal Wan generation: Wan's parameters plus the chunking and the KV window (the card
    sets every default; the chunk size and context timestep are what its weights were trained for)."""

    chunk_frames: int = Field(ge=1, le=64, description="latent frames denoised together (one chunk)")
    context_timestep: int = Field(
        ge=0, le=1000, description="timestep at which a finished chunk is re-run into the KV cache"
    )
    window_frames: int = Field(ge=1, description="latent frames the KV cache holds at most (rolling window)")
    sink_frames: int = Field(ge=0, description="first latent frames the rolling window always keeps")
    session_id: str | None = Field(
        None, max_length=64, description="continue this open session's video (its frames, cache and window)"
    )

    def check(self, card: ModelCard, loop_id: str) -> None:
        super().check(card, loop_id)
        if self.guidance_scale != 1.0:
            raise ConfigError(
                f"guidance_scale={self.guidance_scale}: the causal loop runs no CFG (its weights are "
                "distilled to sample without it). Fix: use guidance_scale=1.0",
                param="guidance_scale",
            )
        latent = (self.num_frames - 1) // 4 + 1
        if latent % self.chunk_frames:
            fit = max(1, latent // self.chunk_frames) * self.chunk_frames
            raise ConfigError(
                f"num_frames={self.num_frames} makes {latent} latent frames, not a multiple of "
                f"chunk_frames={self.chunk_frames}: every chunk holds chunk_frames latent frames. Fix: use "
                f"num_frames={(fit - 1) * 4 + 1}",
                param="num_frames",
            )
        if self.sink_frames + self.chunk_frames > self.window_frames:
            raise ConfigError(
                f"window_frames={self.window_frames} cannot hold sink_frames={self.sink_frames} plus a chunk of "
                f"chunk_frames={self.chunk_frames}: the window keeps the sinks and makes room for each new "
                f"chunk. Fix: use window_frames>={self.sink_frames + self.chunk_frames}",
                param="window_frames",
            )


# ---- the rolling window ----


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


# ---- schedule ----


def shifted(timestep: float, shift: float, train_steps: int = 1000) -> float:
    """A timestep under the flow shift, as a noise level sigma in 0..1."""
    s = timestep / train_steps
    return shift * s / (1 + (shift - 1) * s)


def chunk_schedule(
    fixed: list[int], shift: float, train_steps: int = 1000
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed denoise timesteps of every chunk under the flow shift: the model's timesteps [steps]
    and the sigmas [steps + 1] ending at 0 (Self-Forcing's warped few-step list)."""
    sigmas = torch.tensor([shifted(t, shift, train_steps) for t in fixed] + [0.0], dtype=torch.float32)
    return sigmas[:-1] * train_steps, sigmas


def renoise(x0: torch.Tensor, sigma: float, generator: torch.Generator | None) -> torch.Tensor:
    """``x0`` noised to flow level ``sigma`` with fresh noise from the request's generator (x0 at 0)."""
    if sigma == 0:
        return x0
    noise = torch.randn(x0.shape, generator=generator, dtype=x0.dtype).to(x0.device)  # a CPU generator
    return (1 - sigma) * x0 + sigma * noise


# ---- block-causal transformer ----


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
    hidden = hidden + cross_attention(block.attn2, norm, prep.kv[:, index])
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
) -> dict[str, torch.Tensor]:
    """Flow velocity of ``latents`` [B, C, F, H, W] at ``timestep`` ([B] or per token [B, tokens]) given
    text keys/values ``kv``, the frames' ``rope`` and every block's cached keys/values ``ctx_k``/``ctx_v``
    [B, blocks, H, S, D] under ``mask`` (or what ``select(index, q, ctx_k, ctx_v)`` keeps of them for
    block ``index``: a KV policy); plus the tokens' own keys/values [B, blocks, H, T, D]."""
    prep = prepare(model, latents, timestep, kv)
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
    context is padded to the batch's length with ``ctx_valid`` marking its real tokens. A KV policy
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
    )
    return out if policy is None else {**out, **selector.outputs()}


# ---- the full-recompute reference ----


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


# ---- causal VAE decode ----


def decoder_convs(vae) -> int:
    """Causal convolutions of the VAE decoder (the length of its per-frame feature cache)."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

    return sum(isinstance(m, WanCausalConv3d) for m in vae.decoder.modules())


def chunk_decode_body(vae, inputs: dict[str, Any]) -> dict[str, Any]:
    """A chunk's latents [1, C, n, h, w] to its frames [F, H, W, 3] in 0..1, frame by frame, carrying the
    decoder's causal feature cache (``cache``: the previous chunk's, None for the first chunk) as the
    VAE's own decode does across a whole video; returns the frames and the new cache."""
    z = inputs["latents"].to(vae.dtype)
    mean, inv_std = conditioning.latent_stats(vae, z)
    x = vae.post_quant_conv(z / inv_std + mean)
    first = inputs["cache"] is None
    cache = [None] * decoder_convs(vae) if first else list(inputs["cache"])
    outs = []
    for i in range(x.shape[2]):
        out = vae.decoder(x[:, :, i : i + 1], feat_cache=cache, feat_idx=[0], first_chunk=first and i == 0)
        outs.append(out)
    video = torch.cat(outs, 2)
    if vae.config.patch_size is not None:
        from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

        video = unpatchify(video, patch_size=vae.config.patch_size)
    video = video.clamp(-1.0, 1.0)
    return {"frames": (video * 0.5 + 0.5).clamp(0, 1).permute(0, 2, 3, 4, 1).float()[0], "cache": cache}


# ---- the instance ----


class CausalWanModel(WanModel):
    """A Wan instance whose causal loops keep their chunks' keys/values in a paged KV pool (the card's
    ``causal_kv`` byte budget, allocated whole on first use and counted in the resident bytes)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        v = self.variant
        if v.conditioning != "none" or len(v.experts) > 1 or v.patch[0] != 1:
            raise ConfigError(
                f"card {self.card.model_id!r} runs causal Wan on {str(self.weights)!r}, a folder with "
                f"{v.conditioning!r} image conditioning, experts {list(v.experts)} and patch {v.patch}; causal "
                "Wan runs a text-to-video transformer with one expert and one latent frame per patch (Wan2.1 "
                "T2V). Fix: load a Wan2.1 T2V folder."
            )
        self._pool: PagedKVPool | None = None
        self._pool_lock = threading.Lock()
        self._sessions: Sessions | None = None

    @property
    def sessions(self) -> Sessions:
        """The open sessions (videos continued across requests) over the KV pool."""
        pool = self.kv_pool
        with self._pool_lock:
            if self._sessions is None:
                self._sessions = Sessions(pool)
            return self._sessions

    def open_session(self, ttl_s: float = DEFAULT_TTL_S) -> str:
        """A new session's id: requests with ``session_id`` continue one video, chunk after chunk."""
        return self.sessions.open(ttl_s)

    @property
    def rope_frames(self) -> int:
        """Latent frames Wan's rope table places (a session's video can grow up to it)."""
        return int(self.component("transformer").rope.max_seq_len)

    def close_session(self, session_id: str) -> bool:
        """Close a session and return its pages (False: it was not open)."""
        return self.sessions.close(session_id)

    @property
    def kv_budget(self) -> int:
        cache = self.card.caches.get("causal_kv")
        return (cache.max_bytes if cache is not None else None) or DEFAULT_KV_BYTES

    @property
    def kv_pool(self) -> PagedKVPool:
        """The pool of every causal request's cached keys/values (pages of ``page_size`` tokens)."""
        with self._pool_lock:
            if self._pool is None:
                import json

                config = json.loads((self.weights / "transformer" / "config.json").read_text())
                self._pool = PagedKVPool(
                    int(config["num_layers"]),
                    int(config["num_attention_heads"]),
                    int(config["attention_head_dim"]),
                    page_size=self.page_size,
                    max_bytes=self.kv_budget,
                    dtype=self.dtype,
                    device=self.device,
                )
            return self._pool

    @property
    def page_size(self) -> int:
        """Tokens per page: a divisor of the tokens of one latent frame at the card's default size (at most
        256), so dropping whole frames from a window returns whole pages."""
        defaults = next(iter(self.card.programs.values())).defaults
        step = self.variant.spatial_scale * 2  # VAE x scale, patch x 2
        tokens = (int(defaults.get("height", 480)) // step) * (int(defaults.get("width", 832)) // step)
        return math.gcd(max(tokens, 1), 256)

    def resident_bytes(self) -> int:
        return super().resident_bytes() + self.kv_budget
