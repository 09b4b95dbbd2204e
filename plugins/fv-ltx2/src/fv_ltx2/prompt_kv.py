"""The prompt's keys and values of every block's text cross-attention, computed once per request.

In LTX-2.0 the text side of each block's prompt cross-attention (``attn2`` for video, ``audio_attn2``
for audio) depends on the prompt and the weights only: the caption projection of the connectors'
output, then each block's normalised key and its value. :func:`prompt_kv_body` computes them once per
prompt row, and every denoise call of the request (every step and every guidance branch) takes them as
inputs instead of its text. :class:`PromptKVAttention`, installed on those attentions, reads them when
a block hands it a 4-D ``encoder_hidden_states`` ([rows, 2, text tokens, dim]: the key, then the value)
and otherwise runs the processor it replaced; its query side is the same as diffusers' processors', so
a call on cached keys/values equals the call on the text bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn

from fv_core.adapters import adapter_tag
from fv_core.cache import CacheKey
from fv_core.loop import LoopState, WorkPlan, WorkUnitKind, batch_key, pinned
from fv_ltx2.transformer import unsupported

PROMPT_ATTENTIONS = {"video": "attn2", "audio": "audio_attn2"}  # stream -> its text cross-attention


def cacheable(config: Any) -> bool:
    """Whether this transformer's prompt keys/values are step-invariant and fv can drive it block by
    block (LTX-2.0; not the prompt-modulated LTX-2.3 attentions)."""
    modulated = config.get("cross_attn_mod") or config.get("audio_cross_attn_mod")
    return unsupported(config) is None and not modulated


def prompt_kv(transformer, video_text: torch.Tensor, audio_text: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every block's prompt keys and values: ``video_kv`` [rows, blocks, 2, text tokens, video dim] and
    ``audio_kv`` likewise (the same ops, in the same order, as the transformer's forward runs them)."""
    m, rows = transformer, video_text.shape[0]
    if m.config.use_prompt_embeddings:
        video_text = m.caption_projection(video_text).view(rows, -1, m.proj_in.out_features)
        audio_text = m.audio_caption_projection(audio_text).view(rows, -1, m.audio_proj_in.out_features)
    out = {}
    for stream, text in (("video", video_text), ("audio", audio_text)):
        attns = [getattr(block, PROMPT_ATTENTIONS[stream]) for block in m.transformer_blocks]
        out[f"{stream}_kv"] = torch.stack(
            [torch.stack([a.norm_k(a.to_k(text)), a.to_v(text)], 1) for a in attns], 1
        )
    return out


def prompt_kv_body(transformer, inputs: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The step body of a request's ``prompt_kv`` phase: :func:`prompt_kv` of its text rows."""
    return prompt_kv(transformer, inputs["video_text"], inputs["audio_text"])


# ---- the request's phase, and the instance's cache of them ----


def prompt_kv_plan(instance, state: LoopState, transformer, precision: str) -> WorkPlan:
    """The ``prompt_kv`` phase: the keys/values of the request's prompt rows ([negative,] prompt) on its
    pinned transformer; batchable with other requests' of the same text length."""
    t = state.tensors
    inputs = {"video_text": t["video_text"], "audio_text": t["audio_text"]}
    shapes = tuple(tuple(x.shape[1:]) for x in inputs.values())
    return WorkPlan(
        kind=WorkUnitKind.ENCODER_CHUNK,
        body=partial(prompt_kv_body, transformer),
        inputs=inputs,
        batch_key=batch_key(instance, state, "transformer", "prompt_kv", shapes, precision),
        batch_size=t["video_text"].shape[0],
        label="prompt keys/values",
    )


def kv_keys(state: LoopState, text_keys: list[CacheKey]) -> list[CacheKey]:
    """Each prompt row's keys/values key: its text features' key (tokens, text encoder, connectors and
    their adapters) with the pinned transformer's version and the request's transformer adapters."""
    return [
        CacheKey(
            k.model,
            "transformer",
            pinned(state, "transformer"),
            k.content_hash,
            tuple(
                sorted(
                    (
                        *k.extra,
                        ("connectors_version", k.weights_version),
                        ("transformer_adapters", adapter_tag(state, "transformer")),
                    )
                )
            ),
        )
        for k in text_keys
    ]


def cached_prompt_kv(instance, state: LoopState, text_keys: list[CacheKey]) -> bool:
    """Take the request's prompt keys/values from the instance's cache when every row is there."""
    rows = [instance.kv_cache.get(k) for k in kv_keys(state, text_keys)]
    state.values["kv_cache_hits"] += sum(r is not None for r in rows)
    if any(r is None for r in rows):
        return False
    for i, name in enumerate(("video_kv", "audio_kv")):
        state.tensors[name] = torch.stack([r[i] for r in rows])
    return True


def put_prompt_kv(
    instance, state: LoopState, text_keys: list[CacheKey], out: dict[str, torch.Tensor]
) -> None:
    """Keep the computed keys/values in the request and, row by row, in the instance's cache."""
    for row, key in enumerate(kv_keys(state, text_keys)):
        instance.kv_cache.put(key, (out["video_kv"][row], out["audio_kv"][row]))
    state.tensors.update(video_kv=out["video_kv"], audio_kv=out["audio_kv"])
    state.values["phase"] = "denoise"


# ---- the attention processor ----


@dataclass(frozen=True, slots=True)
class PromptKVAttention:
    """A diffusers processor for a block's text cross-attention that takes the prompt's keys/values
    precomputed (see the module docstring)."""

    inner: Any  # the processor it replaced: it runs every call made on text

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        query_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        key_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        **stg: Any,
    ) -> torch.Tensor:
        if encoder_hidden_states is None or encoder_hidden_states.ndim != 4:
            args = (encoder_hidden_states, attention_mask, query_rotary_emb, key_rotary_emb)
            return self.inner(attn, hidden_states, *args, **stg)
        key, value = encoder_hidden_states.unbind(1)
        rows, length = key.shape[0], key.shape[1]
        if attention_mask is not None:
            attention_mask = attn.prepare_attention_mask(attention_mask, length, rows)
            attention_mask = attention_mask.view(rows, attn.heads, -1, attention_mask.shape[-1])
        query = attn.norm_q(attn.to_q(hidden_states))
        out = dispatch_attention_fn(
            *(t.unflatten(2, (attn.heads, -1)) for t in (query, key, value)),
            attn_mask=attention_mask,
            dropout_p=0.0,
            is_causal=False,
            backend=getattr(self.inner, "_attention_backend", None),
            parallel_config=getattr(self.inner, "_parallel_config", None),
        )
        out = out.flatten(2, 3).to(query.dtype)
        if attn.to_gate_logits is not None:  # per-head gates, as diffusers' processors apply them
            gates = 2.0 * torch.sigmoid(attn.to_gate_logits(hidden_states))
            out = (out.unflatten(2, (attn.heads, -1)) * gates.unsqueeze(-1)).flatten(2, 3)
        return attn.to_out[1](attn.to_out[0](out))


def install(transformer: Any) -> None:
    """Put :class:`PromptKVAttention` on every block's text cross-attentions (once)."""
    for block in transformer.transformer_blocks:
        for name in PROMPT_ATTENTIONS.values():
            attn = getattr(block, name)
            if not isinstance(attn.processor, PromptKVAttention):
                attn.set_processor(PromptKVAttention(attn.processor))
