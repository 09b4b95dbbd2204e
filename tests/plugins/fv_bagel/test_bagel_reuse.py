"""Prefix caching and speculative decoding on the tiny (row-invariant) card: a request that starts like an
earlier one prefills only what it adds (a shared first turn, the previous turn of a conversation, a t2i
prompt), and its output equals the uncached run bit for bit; prompt-lookup drafts verified in one step give
the tokens one token a step gives, greedy and seeded, alone and batched with other requests."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fv_bagel import chat_loop
from fv_bagel.chat_loop import lookup_draft
from fv_bagel.context import text_ids
from fv_core import ConfigError, TextPart
from fv_core.runtime import Engine

SYSTEM = TextPart("you are a careful assistant who answers in short sentences about pictures and cats")


def chat(bagel, parts=(), cached: bool = True, **params):
    """A chat's LoopResult (its token ids), with or without the prefix cache."""
    bagel.instance.prefix_caching = cached
    try:
        return Engine().run_one(*bagel.job(bagel.prepare(params, task="chat", parts=list(parts))))
    finally:
        bagel.instance.prefix_caching = True


def test_a_shared_first_turn_and_the_previous_turn_are_served_from_the_cache(bagel):
    bagel.instance.kv_pool.drain()
    first = chat(bagel, [SYSTEM], prompt="what is red?", max_tokens=8)
    assert first.metrics["cached_prompt_tokens"] == 0
    other = chat(bagel, [SYSTEM], prompt="and blue?", max_tokens=8, temperature=0.7, seed=1)
    system_tokens = len(bagel.instance.tokenizer.encode(SYSTEM.text)) + 2
    assert other.metrics["cached_prompt_tokens"] >= system_tokens
    want = chat(bagel, [SYSTEM], cached=False, prompt="and blue?", max_tokens=8, temperature=0.7, seed=1)
    assert torch.equal(other.outputs["tokens"], want.outputs["tokens"])

    # the next turn: the conversation so far as parts; the previous turn's context (its answer's
    # tokens too, as far as the answer's text tokenizes back to them) is not prefilled again
    talk = [SYSTEM, TextPart("what is red?"), TextPart(first.outputs["text"])]
    second = chat(bagel, talk, prompt="why?", max_tokens=8)
    turn = system_tokens + len(bagel.instance.tokenizer.encode("what is red?")) + 3
    assert second.metrics["cached_prompt_tokens"] >= turn
    want = chat(bagel, talk, cached=False, prompt="why?", max_tokens=8)
    assert torch.equal(second.outputs["tokens"], want.outputs["tokens"])
    assert bagel.instance.prefix.stats.hits >= 2 and bagel.instance.kv_pool.drain() == 0


def test_t2i_requests_with_the_same_prompt_prefill_it_once(bagel):
    bagel.instance.kv_pool.drain()
    params = dict(task="t2i", prompt="a red cat on a wooden table", num_inference_steps=2)
    first = bagel.generate(**params, seed=1)
    again = bagel.generate(**params, seed=2)
    prompt = len(bagel.instance.tokenizer.encode(params["prompt"])) + 2
    assert first.provenance["metrics"]["cached_prompt_tokens"] == 0
    assert again.provenance["metrics"]["cached_prompt_tokens"] == prompt
    bagel.instance.prefix_caching = False
    try:
        assert np.array_equal(again.image, bagel.generate(**params, seed=2).image)
    finally:
        bagel.instance.prefix_caching = True


def test_speculative_decoding_gives_the_same_tokens_alone_and_batched(bagel, monkeypatch):
    """Random tiny weights rarely repeat themselves, so besides prompt lookup's own drafts (one token a step
    in the same calls as another request), an oracle drafts the answer one token a step gives: all right
    (greedy), or every second token wrong (seeded sampling). The tokens equal one token a step's anyway."""
    bagel.instance.kv_pool.drain()
    cases = [
        {"prompt": "a red cat a red cat a red cat", "max_tokens": 16, "speculative_k": 4},
        {"prompt": "describe the image", "max_tokens": 12, "temperature": 0.9, "seed": 4, "speculative_k": 3},
        {"prompt": "hello", "max_tokens": 10},  # one token a step, in the same calls
    ]
    want = [chat(bagel, cached=False, **{**p, "speculative_k": 0}) for p in cases]
    looked_up = Engine(max_batch_rows=3).run_batched(
        [bagel.job(bagel.prepare(p, task="chat")) for p in cases]
    )
    oracle = {}
    for params, result in zip(cases[:2], want, strict=False):
        prompt = tuple(text_ids(bagel.instance, params["prompt"]))
        oracle[prompt] = (result.outputs["tokens"].tolist(), "temperature" in params)

    def draft(history, ngram, k):
        answer, wrong = _find(oracle, history)
        j = len(history) - history.index(bagel.instance.special["eos_token_id"]) - 2  # tokens generated
        return [t + 1 if wrong and i % 2 else t for i, t in enumerate(answer[j : j + k])]

    monkeypatch.setattr(chat_loop, "lookup_draft", draft)
    drafted = Engine(max_batch_rows=3).run_batched([bagel.job(bagel.prepare(p, task="chat")) for p in cases])
    for run in (looked_up, drafted):
        for result, expected in zip(run, want, strict=True):
            assert torch.equal(result.outputs["tokens"], expected.outputs["tokens"])
    greedy, seeded = (r.metrics for r in drafted[:2])
    assert greedy["speculative"]["accepted"] == greedy["speculative"]["drafted"] > 0
    assert greedy["steps"] < greedy["completion_tokens"] / 2  # up to 5 tokens a step
    assert 0 < seeded["speculative"]["accepted"] < seeded["speculative"]["drafted"]
    assert "speculative" not in drafted[2].metrics and drafted[2].metrics["decode_tokens_per_s"] > 0


def _find(oracle, history):
    """The oracle's answer of the request whose context ``history`` starts with."""
    return next(v for prompt, v in oracle.items() if tuple(history[: len(prompt)]) == prompt)


def test_prompt_lookup_drafts_what_followed_the_last_ngram():
    history = [5, 6, 7, 8, 9, "img:0", 5, 6, 7]
    assert lookup_draft(history, 3, 2) == [8, 9]
    assert lookup_draft(history, 3, 4) == [8, 9]  # an image's token ends the draft
    assert lookup_draft([1, 2, 3, 4], 2, 3) == []  # nothing recurs
    assert lookup_draft([1, 2, 9, 1, 3, 1], 2, 2) == [3, 1]  # the latest occurrence of the longest match


def test_speculative_params_are_checked(bagel):
    with pytest.raises(ConfigError, match="speculative_k"):
        bagel.prepare({"prompt": "x", "speculative_k": 40}, task="chat")
    with pytest.raises(ConfigError, match="speculative_ngram"):
        bagel.prepare({"prompt": "x", "speculative_ngram": 0}, task="chat")


def test_consecutive_texts_prefill_as_one_block_with_the_same_tokens(bagel, monkeypatch):
    talk = [SYSTEM, TextPart("hello"), TextPart("hi, what is it?")]
    one_block = chat(bagel, talk, cached=False, prompt="a cat?", max_tokens=6, temperature=0.9, seed=3)
    monkeypatch.setattr(chat_loop, "merged", lambda segments: segments)
    per_text = chat(bagel, talk, cached=False, prompt="a cat?", max_tokens=6, temperature=0.9, seed=3)
    assert torch.equal(one_block.outputs["tokens"], per_text.outputs["tokens"])
    assert one_block.metrics["prompt_tokens"] == per_text.metrics["prompt_tokens"]


def test_requests_arriving_together_prefill_their_shared_prefix_once(bagel):
    """Three chats with one system prompt submitted at once: the first prefills it, the others wait for it
    and prefill only their questions; the tokens equal the uncached runs'."""
    prompts = ["what is red?", "and blue?", "a cat?"]
    want = [chat(bagel, [SYSTEM], cached=False, prompt=p, max_tokens=6) for p in prompts]
    bagel.instance.kv_pool.drain()
    jobs = [
        bagel.job(bagel.prepare({"prompt": p, "max_tokens": 6}, task="chat", parts=[SYSTEM])) for p in prompts
    ]
    together = Engine(max_batch_rows=3).run_batched(jobs)
    system_tokens = len(bagel.instance.tokenizer.encode(SYSTEM.text)) + 2
    assert together[0].metrics["cached_prompt_tokens"] == 0
    assert all(r.metrics["cached_prompt_tokens"] >= system_tokens for r in together[1:])
    for result, expected in zip(together, want, strict=True):
        assert torch.equal(result.outputs["tokens"], expected.outputs["tokens"])
    pool = bagel.instance.kv_pool
    assert pool.reserved_pages == 0 and pool.drain() == 0


def test_think_t2i_thinking_starts_from_the_prefix_cache(bagel):
    """The same think-t2i request again: its thinking stage is served whole from the cache (the contexts it
    hands the image stage too), and the image equals the uncached run's."""
    params = dict(task="think-t2i", prompt="a red cat", max_tokens=4, num_inference_steps=2, seed=3)
    bagel.instance.kv_pool.drain()
    first = bagel.generate(**params)
    again = bagel.generate(**params)
    thinking = [r.provenance["metrics"]["stages"]["0:think"] for r in (first, again)]
    assert thinking[0]["cached_prompt_tokens"] == 0
    assert thinking[1]["cached_prompt_tokens"] == thinking[1]["prompt_tokens"] > 0
    bagel.instance.prefix_caching = False
    try:
        uncached = bagel.generate(**params)
    finally:
        bagel.instance.prefix_caching = True
    assert np.array_equal(again.image, uncached.image)
    assert bagel.instance.kv_pool.drain() == 0


def test_the_first_token_comes_from_the_prompts_prefill_with_the_same_tokens(bagel, monkeypatch):
    calls = []
    for name in ("text_body", "token_body"):
        body = getattr(chat_loop.bodies, name)
        monkeypatch.setattr(chat_loop.bodies, name, lambda *a, _b=body, _n=name: calls.append(_n) or _b(*a))
    params = dict(prompt="a cat?", max_tokens=5, temperature=0.9, seed=3)
    fused = chat(bagel, [SYSTEM], cached=False, **params)
    assert calls == ["text_body"] + ["token_body"] * 4 and fused.metrics["completion_tokens"] == 5
    monkeypatch.setattr(chat_loop.ChatLoop, "_fuses", staticmethod(lambda s: False))
    apart = chat(bagel, [SYSTEM], cached=False, **params)
    assert torch.equal(fused.outputs["tokens"], apart.outputs["tokens"])
    assert fused.metrics["prompt_tokens"] == apart.metrics["prompt_tokens"]
