"""Wan's caches under byte budgets: K/V entries stored without their padding repeats (bit-exact),
resident bytes counting the cache budgets, admission refusing what the budgets cannot hold."""

from __future__ import annotations

import pytest
import torch
from wan_support import request, run, tiny_instance

from fv_core.errors import AdmissionInfeasible
from fv_core.runtime import Budget, Engine
from fv_core.runtime.admission import resident_bytes
from fv_wan.loop import WanLoop
from fv_wan.transformer import text_kv


def test_cached_text_kv_is_compact_and_bit_exact(tiny_path):
    model = tiny_instance(tiny_path)
    first = run(model, seed=3, num_inference_steps=2)
    transformer = model.component("transformer")
    embeds = {k: model.feature_cache.get(k) for k in model.feature_cache.keys()}
    full = 0
    for key in model.kv_cache.keys():
        text = next(e for k, e in embeds.items() if k.content_hash == key.content_hash)
        with torch.no_grad():
            fresh = text_kv(transformer, text[None])[0]
        full += fresh.nbytes
        cached = model.kv_cache.get(key)
        assert torch.equal(cached.view(torch.int32), fresh.view(torch.int32))
    assert model.kv_cache.nbytes < full / 20  # 512 padded text rows, a few real tokens each
    again = run(model, seed=3, num_inference_steps=2)
    assert again.metrics["kv_cache_hits"] == 2
    assert torch.equal(first.outputs["frames"], again.outputs["frames"])


def test_resident_bytes_count_weights_and_cache_budgets(tiny_path):
    model = tiny_instance(tiny_path)
    run(model, num_inference_steps=1)
    budgets = sum(c.max_bytes for c in model.card.caches.values())
    assert budgets > 0 and resident_bytes(model) == model.weights_bytes() + budgets
    assert model.cache_bytes()["text_kv"] == model.kv_cache.nbytes > 0


def test_admission_refuses_a_budget_without_room_for_the_caches(tiny_path):
    model = tiny_instance(tiny_path)
    run(model, num_inference_steps=1)  # components resident
    engine = Engine(Budget(memory_bytes=model.weights_bytes() + (1 << 20)))
    with pytest.raises(AdmissionInfeasible, match=f"memory needs {resident_bytes(model)} resident"):
        engine.run_one(WanLoop(model), request(model, rid="tight"), model)
