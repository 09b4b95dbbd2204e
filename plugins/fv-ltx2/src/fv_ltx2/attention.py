"""Ulysses sequence parallelism for the LTX-2 attentions whose keys span a sharded sequence.

Under sequence parallelism each rank holds a shard of the video tokens and a shard of the audio
tokens. Video self-attention, audio self-attention and the audio->video / video->audio
cross-attentions need every key, so :class:`UlyssesAttention` projects, normalises and rotates this
rank's tokens (RoPE tables made from their global coordinates), swaps to all tokens of this rank's share
of the heads (all-to-all; queries and keys may come from streams of different lengths), runs SDPA, and
swaps back before the per-head gate and the output projection. Text cross-attention keeps its queries
sharded and its (unsharded) text keys, and needs nothing. Outside a sequence-parallel step the processor
hands the call to the one it replaced, so the transformer behaves exactly as before.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from diffusers.models.transformers.transformer_ltx2 import (
    apply_interleaved_rotary_emb,
    apply_split_rotary_emb,
)

from fv_core.parallel import heads_to_seq, seq_to_heads, sequence_parallel

# block attribute -> (stream of its queries, stream of its keys and values)
SHARDED = {
    "attn1": ("video", "video"),
    "audio_attn1": ("audio", "audio"),
    "audio_to_video_attn": ("video", "audio"),
    "video_to_audio_attn": ("audio", "video"),
}

# Full token count of each stream of the forward running in this context (None outside one).
STREAM_TOKENS: ContextVar[dict[str, int] | None] = ContextVar("fv_ltx2_stream_tokens", default=None)


@contextmanager
def stream_tokens(video: int, audio: int) -> Iterator[None]:
    """The blocks run inside this context see ``video`` and ``audio`` tokens in all (over every shard)."""
    reset = STREAM_TOKENS.set({"video": video, "audio": audio})
    try:
        yield
    finally:
        STREAM_TOKENS.reset(reset)


@dataclass(frozen=True, slots=True)
class UlyssesAttention:
    """A diffusers attention processor for one of LTX-2's :data:`SHARDED` attentions."""

    inner: Any  # the processor it replaced: it runs every call made outside sequence parallelism
    query: str  # stream of the queries ("video" or "audio")
    key: str  # stream of the keys and values

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        query_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        key_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        perturbation_mask: torch.Tensor | None = None,
        all_perturbed: bool | torch.Tensor | None = None,
    ) -> torch.Tensor:
        tokens = STREAM_TOKENS.get()
        if sequence_parallel() is None or tokens is None:
            stg = {"perturbation_mask": perturbation_mask, "all_perturbed": all_perturbed}
            extra = {k: v for k, v in stg.items() if v is not None}  # only perturbed processors take them
            args = (encoder_hidden_states, attention_mask, query_rotary_emb, key_rotary_emb)
            return self.inner(attn, hidden_states, *args, **extra)
        if attention_mask is not None:
            raise ValueError("sequence-parallel LTX-2 attention takes no attention mask (fv passes none)")
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        value = attn.to_v(context)
        if all_perturbed is None:  # as the perturbed processor decides it
            all_perturbed = perturbation_mask is not None and bool((perturbation_mask == 0).all())
        if all_perturbed:  # STG: the values stand in for the attention
            out = value
        else:
            out = self._attend(attn, hidden_states, context, value, query_rotary_emb, key_rotary_emb, tokens)
            if perturbation_mask is not None:
                out = torch.lerp(value, out, perturbation_mask)
        if attn.to_gate_logits is not None:  # per-head gates of this rank's tokens
            gates = 2.0 * torch.sigmoid(attn.to_gate_logits(hidden_states))
            out = (out.unflatten(2, (attn.heads, -1)) * gates.unsqueeze(-1)).flatten(2, 3)
        return attn.to_out[1](attn.to_out[0](out))

    def _attend(self, attn, hidden, context, value, query_rope, key_rope, tokens) -> torch.Tensor:
        query, key = attn.norm_q(attn.to_q(hidden)), attn.norm_k(attn.to_k(context))
        if query_rope is not None:
            query = _rotate(attn, query, query_rope)
            key = _rotate(attn, key, key_rope if key_rope is not None else query_rope)
        q_len, k_len = tokens[self.query], tokens[self.key]
        q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (query, key, value))
        q, k, v = seq_to_heads(q, q_len), seq_to_heads(k, k_len), seq_to_heads(v, k_len)
        out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), dropout_p=0.0)
        return heads_to_seq(out.transpose(1, 2), q_len).flatten(2, 3).to(query.dtype)


def _rotate(attn: Any, x: torch.Tensor, table: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """RoPE on ``x`` [B, tokens, heads * head_dim] with diffusers' LTX-2 functions; "split" tables
    [B, heads, tokens, r] get ``x`` per head (diffusers' own reshape cannot size a shard of no tokens)."""
    if attn.rope_type != "split":
        return apply_interleaved_rotary_emb(x, table)
    per_head = x.unflatten(2, (table[0].shape[1], -1)).transpose(1, 2)
    return apply_split_rotary_emb(per_head, table).transpose(1, 2).flatten(2, 3)


def install(transformer: Any) -> None:
    """Put :class:`UlyssesAttention` on every sharded attention of ``transformer`` (once)."""
    for block in transformer.transformer_blocks:
        for name, (query, key) in SHARDED.items():
            attn = getattr(block, name)
            if not isinstance(attn.processor, UlyssesAttention):
                attn.set_processor(UlyssesAttention(attn.processor, query, key))
