"""The prompt side of the Wan loops: its normalisation, and the instance's two caches of it.

The feature cache keeps each prompt row's UMT5 embeddings, the KV cache each row's per-block text
keys/values of one expert; both are keyed by the weights versions the request pinned, so a weight sync
never serves stale features. Text keys/values are put folded (``RepeatedTail``: without their padding's
repeats) and taken back folded or whole.
"""

from __future__ import annotations

import html
import re

import torch

from fv_core.adapters import adapter_tag
from fv_core.cache import CacheKey, RepeatedTail, fold_tail
from fv_core.loop import LoopState, pinned


def clean_prompt(text: str) -> str:
    """The prompt normalisation Wan's pipeline applies (ftfy when installed, html unescape, spaces)."""
    try:
        import ftfy

        text = ftfy.fix_text(text)
    except ImportError:
        pass
    return re.sub(r"\s+", " ", html.unescape(html.unescape(text)).strip()).strip()


def text_keys(instance, state: LoopState) -> list[CacheKey]:
    """The feature-cache key of each prompt row (its tokens on the pinned text encoder)."""
    ids, mask = state.tensors["input_ids"], state.tensors["mask"]
    version = pinned(state, "text_encoder")
    return [
        CacheKey.of(
            instance.card.model_id,
            "text_encoder",
            version,
            ids[i],
            mask[i],
            max_length=int(ids.shape[-1]),
            precision=str(instance.dtype),
            adapters=adapter_tag(state, "text_encoder"),  # a text-encoder LoRA makes other features
        )
        for i in range(ids.shape[0])
    ]


def kv_keys(instance, state: LoopState, expert: str) -> list[CacheKey]:
    """The KV-cache key of each prompt row's text keys/values on ``expert`` (both pinned versions)."""
    te = pinned(state, "text_encoder")
    return [
        CacheKey(
            k.model,
            expert,
            pinned(state, expert),
            k.content_hash,
            # the text encoder's adapters are in k.extra; the expert's (its cross-attention projections) here
            tuple(
                sorted(
                    (*k.extra, ("text_encoder_version", te), ("expert_adapters", adapter_tag(state, expert)))
                )
            ),
        )
        for k in text_keys(instance, state)
    ]


def set_embeds(state: LoopState, embeds: torch.Tensor) -> None:
    """Store the prompt embeddings: row 0 the prompt, row 1 (under CFG) the negative prompt."""
    state.tensors["text"] = embeds[:1]
    if embeds.shape[0] > 1:
        state.tensors["neg_text"] = embeds[1:2]


def put_kv(instance, state: LoopState, expert: str, kv: torch.Tensor, held: torch.Tensor | None) -> None:
    """Cache each prompt row's text keys/values ``kv`` of ``expert`` folded (``held``: positions each
    row's fold holds, when ``kv`` came folded)."""
    length = state.tensors["input_ids"].shape[1]
    for row, key in enumerate(kv_keys(instance, state, expert)):
        folded = (
            fold_tail(kv[row], -2)
            if held is None
            else RepeatedTail(kv[row].narrow(-2, 0, int(held[row])).clone(), length, -2)
        )
        instance.kv_cache.put(key, folded)


def cached_kv(instance, state: LoopState, expert: str, fold: bool = False) -> bool:
    """Take the expert's text keys/values from the cache (``fold``: kept folded) when every prompt
    row is there (image keys/values are never cached: a request with image features computes them)."""
    if "image_features" in state.tensors:
        return False
    kv = [instance.kv_cache.get(k, packed=True) for k in kv_keys(instance, state, expert)]  # RepeatedTails
    state.values["kv_cache_hits"] += sum(x is not None for x in kv)
    if any(x is None for x in kv):
        return False
    if fold:
        keep_folded(state, expert, kv)
    else:
        state.tensors[f"kv.{expert}"] = torch.stack([x.expand() for x in kv])
    return True


def keep_folded(state: LoopState, expert: str, rows: list[RepeatedTail]) -> None:
    """The expert's text keys/values, each prompt row folded (``fold_tail`` along positions), as
    ``kv.{expert}`` [rows, blocks, 2, H, dim] (H: the longest fold; a shorter row repeats its last
    position up to it) and ``kv_rows.{expert}`` (positions each row holds)."""
    held = max(r.head.shape[-2] for r in rows)
    state.tensors[f"kv.{expert}"] = torch.stack([RepeatedTail(r.head, held, -2).expand() for r in rows])
    state.tensors[f"kv_rows.{expert}"] = torch.tensor([r.head.shape[-2] for r in rows])
