"""BAGEL's requests are admitted by KV pages: on a pool that holds two chats' worst case, more chats wait
and then run (bit for bit as alone, never KVPoolFull); a request that can never fit is refused with the
numbers and the fix; reservations and pages come back on finish and cancel, across think-t2i's stages."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from fv_bagel.model import exact_model
from fv_core import AdmissionInfeasible, ConfigError
from fv_core.runtime import Engine

CHATS = [("hello there", 0), ("what is red?", 1), ("say hi", 2), ("count to ten", 3)]


def on_pages(model, pages: int):
    """``model`` on a fresh instance of its card whose kv cache budget holds ``pages`` pages."""
    card = model.card
    kv = card.caches["kv"].model_copy(update={"max_bytes": pages * model.instance.kv_pool.page_bytes})
    small = card.model_copy(update={"caches": {**card.caches, "kv": kv}})
    return dataclasses.replace(model, card=small, instance=exact_model(small, model.weights))


@pytest.fixture(scope="module")
def two_chats(bagel):
    """Six pages: a chat of a short prompt and 30 tokens needs 3 (16 tokens a page), so two fit at once."""
    return on_pages(bagel, 6)


def chat(model, prompt: str, seed: int, max_tokens: int = 30, rid: str | None = None):
    params = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.8, "seed": seed}
    return model.prepare(params, task="chat", request_id=rid or f"{prompt}/{seed}")


def watch(engine: Engine, model) -> list[tuple[int, int, int]]:
    """(running, reserved pages, pages requests hold) after every event (a page the prefix cache keeps
    counts only while a request holds it too)."""
    seen: list[tuple[int, int, int]] = []
    pool, cache = model.instance.kv_pool, model.instance.prefix

    def held() -> int:
        cached = cache.pages()
        return sum(refs > (page in cached) for page, refs in enumerate(pool.refs))

    engine.on_event = lambda e: seen.append(
        (int(engine.admission.usage()["running"]), pool.reserved_pages, held())
    )
    return seen


def test_chats_beyond_the_pool_wait_and_equal_solo_runs(two_chats):
    model, pool = two_chats, two_chats.instance.kv_pool
    solo = [Engine().run_one(*model.job(chat(model, p, s))) for p, s in CHATS]
    engine = Engine()
    seen = watch(engine, model)
    together = engine.run_batched([model.job(chat(model, p, s)) for p, s in CHATS])
    for alone, run in zip(solo, together, strict=True):
        assert run is not None and torch.equal(alone.outputs["tokens"], run.outputs["tokens"])
    assert max(r for r, _, _ in seen) == 2  # the other two waited for pages
    assert all(used <= reserved <= pool.num_pages for _, reserved, used in seen)
    assert pool.reserved_pages == 0 and pool.drain() == 0


def test_a_chat_that_can_never_fit_is_refused_with_the_numbers_and_the_fix(two_chats):
    pool = two_chats.instance.kv_pool
    with pytest.raises(
        AdmissionInfeasible,
        match=r"KV needs 13 pages of 16 tokens .* the KV pool holds 6 .*Fix: lower max_tokens, shorten the "
        r"prompt, or raise the card's kv cache budget",
    ):
        two_chats.generate(task="chat", prompt="hello there", max_tokens=200)  # 8 + 200 tokens
    assert pool.reserved_pages == 0 and pool.drain() == 0


def test_pages_return_on_finish_and_on_cancel(two_chats):
    model, pool = two_chats, two_chats.instance.kv_pool
    engine = Engine()
    sched = engine.scheduler(batching=True)
    entries = [sched.submit(*model.job(chat(model, p, s, rid=f"c{i}"))) for i, (p, s) in enumerate(CHATS)]
    for _ in range(4):
        sched.step()
    assert pool.reserved_pages == 6 and 0 < pool.used_pages <= 6
    assert [e.phase for e in entries] == ["running", "running", "waiting", "waiting"]
    sched.cancel("c1")  # running: its pages go to c2
    sched.cancel("c3")  # waiting: it never reserved
    while sched.has_work():
        sched.step()
    assert [e.error is None for e in entries] == [True, False, True, False]
    assert pool.reserved_pages == 0 and pool.drain() == 0 and engine.admission.usage()["running"] == 0


def think(model, rid: str, seed: int = 0):
    params = {"prompt": "a red cat", "max_tokens": 8, "num_inference_steps": 2, "seed": seed}
    return model.prepare(params, task="think-t2i", request_id=rid)


def test_think_t2i_stages_hand_over_pages_counted_once(bagel):
    """think-t2i's AR stage needs 12 pages, its denoise stage 13 (the AR contexts it takes over included):
    two of them and two chats on 16 pages wait for each other, finish as alone, and leave nothing."""
    model = on_pages(bagel, 16)
    pool = model.instance.kv_pool
    items = [think(model, "t0"), chat(model, *CHATS[0]), think(model, "t1", seed=1), chat(model, *CHATS[1])]
    solo = [Engine().run_one(*model.job(r)) for r in items]
    pool.drain()  # a cold prefix cache: every context is prefilled (the order of admissions this test reads)
    engine = Engine()
    seen = watch(engine, model)
    together = engine.run_batched([model.job(r) for r in items])
    for alone, run in zip(solo, together, strict=True):
        assert run is not None
        for name, value in alone.outputs.items():
            assert np.array_equal(np.asarray(value), np.asarray(run.outputs[name])), name
    assert all(used <= reserved <= 16 for _, reserved, used in seen)
    assert pool.reserved_pages == 0 and pool.drain() == 0


def test_a_stage_that_can_never_fit_frees_the_pages_handed_to_it(bagel):
    model = on_pages(bagel, 12)  # the AR stage fits, the denoise stage (13 pages) never does
    pool = model.instance.kv_pool
    with pytest.raises(AdmissionInfeasible, match="KV needs 13 pages"):
        Engine().run_one(*model.job(think(model, "t")))
    assert pool.reserved_pages == 0 and pool.drain() == 0


def test_a_stage_refused_at_init_frees_the_pages_handed_to_it(bagel):
    model = on_pages(bagel, 16)
    with pytest.raises(ConfigError, match="latent table"):  # found by the denoise stage, after the thinking
        model.generate(task="think-t2i", prompt="a red cat", max_tokens=4, num_inference_steps=2, height=160)
    assert model.instance.kv_pool.drain() == 0 and model.instance.kv_pool.reserved_pages == 0
