"""Wan's caches and working sets under byte budgets: K/V entries stored without their padding repeats
(bit-exact), resident bytes counting the cache budgets, admission refusing what the budgets cannot
hold, a batch of latents decoded in row groups."""

from __future__ import annotations

import pytest
import torch
from wan_support import request, run, tiny_instance

from fv_core.errors import AdmissionInfeasible
from fv_core.runtime import Budget, Engine
from fv_core.runtime.admission import resident_bytes
from fv_wan import bodies as loop_module
from fv_wan.bodies import decode_body, decoded_row_bytes
from fv_wan.t2v_loop import WanLoop
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


def test_a_batch_decodes_in_row_groups_under_the_byte_budget(tiny_model, monkeypatch):
    vae = tiny_model.component("vae")
    latents = torch.randn(3, 16, 2, 4, 6, generator=torch.Generator().manual_seed(0))
    calls = []
    decode = vae.decode
    monkeypatch.setattr(vae, "decode", lambda z, **kw: calls.append(len(z)) or decode(z, **kw))
    monkeypatch.setattr(loop_module, "DECODE_BYTES", 2 * decoded_row_bytes(vae, latents))
    with torch.no_grad():
        grouped = decode_body(vae, {"latents": latents})["frames"]
        assert calls == [2, 1]
        alone = [decode_body(vae, {"latents": latents[i : i + 1]})["frames"] for i in range(3)]
        monkeypatch.setattr(loop_module, "DECODE_BYTES", 1)  # every row alone
        rows = decode_body(vae, {"latents": latents})["frames"]
    assert grouped.shape == (3, 5, 32, 48, 3)
    assert torch.equal(rows, torch.cat(alone))  # a row decoded alone is a single request's decode
    assert torch.allclose(grouped, rows, atol=1e-5)
