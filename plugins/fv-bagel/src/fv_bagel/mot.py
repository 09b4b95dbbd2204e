"""BAGEL's Mixture-of-Transformers decoder, written on transformers' Qwen2 pieces.

Every decoder layer holds two experts with the same shapes: the understanding expert (Qwen2.5's own
weights: ``q_proj`` ... ``mlp``, ``input_layernorm`` ...) and the generation expert (the same names
with ``_moe_gen``). Both attend over ONE packed sequence: each token is projected, normed, fed
through the MLP and output-projected by its own expert (text and ViT tokens: understanding; VAE
latent tokens: generation), while attention mixes all of them. Per-head q/k RMSNorm runs before
RoPE; the final norm is routed the same way. Module and parameter names equal the published
``ema.safetensors`` keys under ``language_model.``.

The forward is a pure function of (weights, inputs): a query block of ``T`` tokens per row, the
row's earlier context keys/values (padded to a common length, ``ctx_valid`` marking the real
ones) and a ``T x T`` mask inside the block (causal for text, full for image spans). It returns
the block's hidden states and its keys/values; the caller decides whether to append them to the
context (text, ViT and clean-image spans) or drop them (noised latents: a denoise step reuses the
prefix without writing to it).

``exact=True`` runs every reduction in a form whose result per row does not depend on how many
rows, or how many padded keys, share the call (linear layers as a row-wise product-sum, attention
sums as cumulative sums over keys): a KV-cached decode then equals a full-sequence forward bit for
bit, and ragged batches equal the requests run alone. It costs memory (a ``[rows, out, in]``
product per linear layer) and is meant for tests and the tiny card; ``exact=False`` runs
``F.linear`` and SDPA.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen2Config
from transformers.activations import ACT2FN
from transformers.models.qwen2.modeling_qwen2 import (
    Qwen2MLP,
    Qwen2RMSNorm,
    Qwen2RotaryEmbedding,
    apply_rotary_pos_emb,
)

GEN = "_moe_gen"  # suffix of the generation expert's parameter names


def linear(x: torch.Tensor, layer: nn.Linear, exact: bool) -> torch.Tensor:
    """``layer(x)``; with ``exact``, a row-wise product-sum (the same bits for a row in any batch)."""
    if not exact:
        return F.linear(x, layer.weight, layer.bias)
    y = (x.unsqueeze(-2) * layer.weight).sum(-1)
    return y if layer.bias is None else y + layer.bias


def mlp(m: Qwen2MLP, x: torch.Tensor, exact: bool) -> torch.Tensor:
    """Qwen2's gated MLP: ``down(act(gate(x)) * up(x))``."""
    return linear(m.act_fn(linear(x, m.gate_proj, exact)) * linear(x, m.up_proj, exact), m.down_proj, exact)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, exact: bool
) -> torch.Tensor:
    """Softmax attention ``[B, H, T, d]`` over keys ``[B, H, S, d]``; ``keep`` ``[B, 1, T, S]`` (True: attend)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    if not exact:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=scale)
    scores = (q.unsqueeze(-2) * k.unsqueeze(-3)).sum(-1) * scale  # [B, H, T, S]
    scores = scores.masked_fill(~keep, float("-inf"))
    weights = (scores - scores.amax(-1, keepdim=True)).exp()
    # sums over keys as cumulative sums: masked (zero) and padded keys leave the real keys' sum unchanged
    denom = weights.cumsum(-1)[..., -1:]
    out = (weights.unsqueeze(-1) * v.unsqueeze(-3)).cumsum(-2)[..., -1, :]
    return out / denom


def grouped_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """SDPA's math for a decode step's query ``[B, H, 1, d]`` over grouped keys/values ``[B, kvh, S, d]``,
    read in place (no repeat per head) as a few matmuls: CPU's flash kernel is slow on a single query."""
    b, h, t, d = q.shape
    groups = h // k.shape[1]
    rows = q.reshape(b, k.shape[1], groups * t, d)  # per KV head, its query heads' rows
    scores = (rows @ k.transpose(-1, -2)).float() / math.sqrt(d)
    scores = scores.masked_fill(~keep.repeat(1, 1, groups, 1), float("-inf"))
    return (scores.softmax(-1).to(v.dtype) @ v).reshape(b, h, t, d)


def routed(
    x: torch.Tensor, gen: torch.Tensor | None, und_fn: Callable[[torch.Tensor], torch.Tensor],
    gen_fn: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:  # fmt: skip
    """``und_fn`` on understanding tokens, ``gen_fn`` on generation tokens (``gen`` True), back in place."""
    if gen is None:
        return und_fn(x)
    flat, g = x.reshape(-1, x.shape[-1]), gen.reshape(-1)
    out_und, out_gen = und_fn(flat[~g]), gen_fn(flat[g])
    out = flat.new_empty(flat.shape[0], out_und.shape[-1])
    out[~g], out[g] = out_und, out_gen
    return out.reshape(*x.shape[:-1], out.shape[-1])


class MoTAttention(nn.Module):
    """q/k/v/o projections and per-head q/k RMSNorm of both experts (Qwen2.5: q/k/v with bias, o without)."""

    def __init__(self, config: Qwen2Config) -> None:
        super().__init__()
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(config.num_key_value_heads or config.num_attention_heads)
        self.head_dim = int(config.hidden_size) // self.num_heads
        hidden, q_out, kv_out = (
            config.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        )
        for suffix in ("", GEN):
            setattr(self, f"q_proj{suffix}", nn.Linear(hidden, q_out, bias=True))
            setattr(self, f"k_proj{suffix}", nn.Linear(hidden, kv_out, bias=True))
            setattr(self, f"v_proj{suffix}", nn.Linear(hidden, kv_out, bias=True))
            setattr(self, f"o_proj{suffix}", nn.Linear(q_out, hidden, bias=False))
            setattr(self, f"q_norm{suffix}", Qwen2RMSNorm(self.head_dim, eps=config.rms_norm_eps))
            setattr(self, f"k_norm{suffix}", Qwen2RMSNorm(self.head_dim, eps=config.rms_norm_eps))


class MoTDecoderLayer(nn.Module):
    """One layer: attention, MLP and the two RMSNorms of each expert."""

    def __init__(self, config: Qwen2Config) -> None:
        super().__init__()
        self.self_attn = MoTAttention(config)
        for suffix in ("", GEN):
            setattr(self, f"mlp{suffix}", Qwen2MLP(config))
            setattr(
                self, f"input_layernorm{suffix}", Qwen2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            )
            setattr(
                self,
                f"post_attention_layernorm{suffix}",
                Qwen2RMSNorm(config.hidden_size, eps=config.rms_norm_eps),
            )

    def qkv(self, x: torch.Tensor, suffix: str, exact: bool) -> torch.Tensor:
        """Normed q, k, v of tokens ``[N, D]`` by one expert, concatenated on the last dim."""
        a = self.self_attn
        x = getattr(self, f"input_layernorm{suffix}")(x)
        q = linear(x, getattr(a, f"q_proj{suffix}"), exact).unflatten(-1, (a.num_heads, a.head_dim))
        k = linear(x, getattr(a, f"k_proj{suffix}"), exact).unflatten(-1, (a.num_kv_heads, a.head_dim))
        v = linear(x, getattr(a, f"v_proj{suffix}"), exact)
        q, k = getattr(a, f"q_norm{suffix}")(q), getattr(a, f"k_norm{suffix}")(k)
        return torch.cat([q.flatten(-2), k.flatten(-2), v], dim=-1)

    def ffn(self, x: torch.Tensor, suffix: str, exact: bool) -> torch.Tensor:
        return mlp(
            getattr(self, f"mlp{suffix}"), getattr(self, f"post_attention_layernorm{suffix}")(x), exact
        )

    def forward(
        self,
        h: torch.Tensor,
        gen: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        ctx_k: torch.Tensor,
        ctx_v: torch.Tensor,
        keep: torch.Tensor,
        exact: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``h`` ``[B, T, D]``; context ``[B, kvh, S, d]``; returns ``h`` and the block's k, v ``[B, kvh, T, d]``."""
        a = self.self_attn
        b, t, _ = h.shape
        qkv = routed(h, gen, lambda x: self.qkv(x, "", exact), lambda x: self.qkv(x, GEN, exact))
        nq, nkv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        q = qkv[..., :nq].view(b, t, a.num_heads, a.head_dim).transpose(1, 2)
        k = qkv[..., nq : nq + nkv].view(b, t, a.num_kv_heads, a.head_dim).transpose(1, 2)
        v = qkv[..., nq + nkv :].view(b, t, a.num_kv_heads, a.head_dim).transpose(1, 2)
        cos, sin = rope
        q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
        keys, values = torch.cat([ctx_k, k], dim=2), torch.cat([ctx_v, v], dim=2)
        groups = a.num_heads // a.num_kv_heads
        if t == 1 and not exact:
            out = grouped_attend(q, keys, values, keep)
        else:
            if groups > 1:
                keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
            out = attend(q, keys, values, keep, exact)
        out = out.transpose(1, 2).reshape(b, t, nq)
        h = h + routed(
            out,
            gen,
            lambda x: linear(x, a.get_submodule("o_proj"), exact),  # type: ignore[arg-type]
            lambda x: linear(x, a.get_submodule("o_proj_moe_gen"), exact),  # type: ignore[arg-type]
        )
        h = h + routed(h, gen, lambda x: self.ffn(x, "", exact), lambda x: self.ffn(x, GEN, exact))
        return h, k, v


class MoTModel(nn.Module):
    """Shared token embeddings, the MoT layers, both experts' final norms and Qwen2's rotary embedding."""

    def __init__(self, config: Qwen2Config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(MoTDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = Qwen2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.norm_moe_gen = Qwen2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen2RotaryEmbedding(config=config)


class MoTLanguageModel(nn.Module):
    """The decoder and its untied LM head (``language_model.*`` in ``ema.safetensors``)."""

    def __init__(self, config: Qwen2Config) -> None:
        super().__init__()
        self.config = config
        self.model = MoTModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        """``(layers, kv heads, head dim)`` of one token's keys (or values)."""
        a = self.model.layers[0].self_attn
        assert isinstance(a, MoTAttention)
        return len(self.model.layers), a.num_kv_heads, a.head_dim

    def forward(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        block_mask: torch.Tensor,
        ctx_k: torch.Tensor | None = None,
        ctx_v: torch.Tensor | None = None,
        ctx_valid: torch.Tensor | None = None,
        gen: torch.Tensor | None = None,
        exact: bool = False,
        ctx_layer: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One block of ``T`` tokens per row over its context.

        :param h: input embeddings ``[B, T, D]``.
        :param positions: RoPE positions ``[B, T]`` (an image's tokens share one).
        :param block_mask: ``[T, T]`` bool, True where a query token sees a block token.
        :param ctx_k: context keys ``[B, layers, kvh, S, d]`` (values alike), padded; None: no context.
        :param ctx_valid: ``[B, S]`` bool, the real context tokens.
        :param gen: ``[B, T]`` bool, tokens of the generation expert (None: all understanding).
        :param ctx_layer: instead of ``ctx_k`` / ``ctx_v``: layer ``i``'s context keys and values
            ``[B, kvh, S, d]`` (read from the KV pool's pages one layer at a time).
        :returns: final hidden states ``[B, T, D]`` (normed by each token's expert) and the block's
            keys and values ``[B, layers, kvh, T, d]``.
        """
        b, t, _ = h.shape
        layers, kvh, d = self.kv_shape
        if ctx_valid is None:
            ctx_k = ctx_v = h.new_zeros(b, layers, kvh, 0, d)
            ctx_valid = torch.zeros(b, 0, dtype=torch.bool, device=h.device)
        if ctx_layer is None:
            assert ctx_k is not None and ctx_v is not None, "a context is ctx_k and ctx_v, or ctx_layer"
            keys_of, values_of = ctx_k, ctx_v
            ctx_layer = lambda i: (keys_of[:, i], values_of[:, i])  # noqa: E731
        keep = torch.cat([ctx_valid[:, None, :].expand(b, t, -1), block_mask.expand(b, t, t)], dim=-1)[
            :, None
        ]
        rope = self.model.rotary_emb(h, positions)
        keys, values = [], []
        for i, layer in enumerate(self.model.layers):
            h, k, v = layer(h, gen, rope, *ctx_layer(i), keep, exact)
            keys.append(k)
            values.append(v)
        h = routed(h, gen, self.model.norm, self.model.norm_moe_gen)
        return h, torch.stack(keys, dim=1), torch.stack(values, dim=1)


class TimestepEmbedder(nn.Module):
    """Sinusoidal features of a flow time in 0..1 (cos then sin, 256 of them) through a 2-layer SiLU MLP."""

    def __init__(self, hidden_size: int, frequency_size: int = 256) -> None:
        super().__init__()
        self.frequency_size = frequency_size
        self.mlp = nn.Sequential(
            nn.Linear(frequency_size, hidden_size), nn.SiLU(), nn.Linear(hidden_size, hidden_size)
        )

    def forward(self, t: torch.Tensor, exact: bool = False) -> torch.Tensor:
        from diffusers.models.embeddings import get_timestep_embedding

        freq = get_timestep_embedding(t, self.frequency_size, flip_sin_to_cos=True, downscale_freq_shift=0)
        first, second = self.mlp[0], self.mlp[2]
        assert isinstance(first, nn.Linear) and isinstance(second, nn.Linear)
        return linear(F.silu(linear(freq.to(first.weight.dtype), first, exact)), second, exact)


class PositionEmbedding(nn.Module):
    """A frozen 2-D sin-cos table over a ``side x side`` grid, looked up by flattened ``row * side + col``."""

    def __init__(self, side: int, hidden_size: int) -> None:
        super().__init__()
        self.side = side
        self.pos_embed = nn.Parameter(sincos_2d(hidden_size, side), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.pos_embed[ids]


def sincos_2d(hidden_size: int, side: int) -> torch.Tensor:
    """The MAE-style 2-D sin-cos table ``[side * side, hidden]`` at integer grid positions: row
    ``r * side + c`` is ``[sin(c w), cos(c w), sin(r w), cos(r w)]``, ``w_i = 10000^(-4i / hidden)``
    (diffusers' ``get_2d_sincos_pos_embed`` with ``base_size = side``, which leaves positions unscaled)."""
    from diffusers.models.embeddings import get_2d_sincos_pos_embed

    return get_2d_sincos_pos_embed(hidden_size, side, base_size=side, output_type="pt").float()


class MLPConnector(nn.Module):
    """ViT features to the decoder's width: ``fc2(act(fc1(x)))``."""

    def __init__(self, in_dim: int, out_dim: int, act: str) -> None:
        super().__init__()
        self.act = ACT2FN[act]
        self.fc1 = nn.Linear(in_dim, out_dim)
        self.fc2 = nn.Linear(out_dim, out_dim)

    def forward(self, x: torch.Tensor, exact: bool = False) -> torch.Tensor:
        return linear(self.act(linear(x, self.fc1, exact)), self.fc2, exact)


def grid_ids(rows: int, cols: int, side: int) -> torch.Tensor:
    """Flattened ids ``r * side + c`` of a ``rows x cols`` grid on a table ``side`` wide (BAGEL's
    extrapolating position ids)."""
    return (torch.arange(rows)[:, None] * side + torch.arange(cols)).flatten()
