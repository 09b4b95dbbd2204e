"""The prompt side of the Qwen-Image loop: the template's tokens and the instance's feature cache.

Each prompt row (the prompt, and under true CFG the negative prompt) is tokenized alone, as diffusers
encodes each, so a row's features never depend on what it was batched with. The cache keeps each
row's features (template dropped, cut to ``max_sequence_length``) keyed by its tokens, the pinned
text encoder version, the precision and the text encoder's adapters.
"""

from __future__ import annotations

import torch

from fv_core.adapters import adapter_tag
from fv_core.cache import CacheKey
from fv_core.loop import LoopState, pinned
from fv_qwen_image.bodies import DROP, TEMPLATE
from fv_qwen_image.params import MAX_TEXT

ROWS = ("text", "neg_text")  # state.tensors names of each row's features; ids are "ids.<row>"


def tokenize(tokenizer, prompt: str) -> torch.Tensor:
    """The templated prompt's ids [1, n], truncated as diffusers truncates (1024 + the dropped tokens)."""
    enc = tokenizer(
        [TEMPLATE.format(prompt)],
        max_length=MAX_TEXT + DROP,
        padding=True,
        truncation=True,
        return_tensors="pt",
    )
    return enc.input_ids


def text_key(instance, state: LoopState, row: str) -> CacheKey:
    """The feature-cache key of prompt row ``row`` (its tokens on the pinned text encoder)."""
    return CacheKey.of(
        instance.card.model_id,
        "text_encoder",
        pinned(state, "text_encoder"),
        state.tensors[f"ids.{row}"][0],
        max_length=int(state.values["max_sequence_length"]),
        precision=str(instance.dtype),
        adapters=adapter_tag(state, "text_encoder"),
    )


def take_cached(instance, state: LoopState) -> int:
    """Fill the rows the cache holds; return how many it held."""
    hits = 0
    for row in state.values["rows"]:
        cached = instance.feature_cache.get(text_key(instance, state, row))
        if cached is not None:
            state.tensors[row] = cached.unsqueeze(0)
            hits += 1
    return hits


def put_row(instance, state: LoopState, row: str, embeds: torch.Tensor) -> None:
    """Keep row ``row``'s encoder output, cut to the request's max_sequence_length, and cache it."""
    embeds = embeds[:, : state.values["max_sequence_length"]]
    state.tensors[row] = embeds
    instance.feature_cache.put(text_key(instance, state, row), embeds[0])
