"""Text-embedding feature cache and minimum components per request."""

from __future__ import annotations

import torch
from wan_support import run, tiny_instance

from fv_core.cache import CacheKey


def test_same_prompt_encoded_once_and_version_bump_invalidates_only_its_entries(tiny_path):
    model = tiny_instance(tiny_path)
    first = run(model, seed=1, num_inference_steps=1)
    assert first.metrics["text_cache_hits"] == 0 and first.metrics["kv_cache_hits"] == 0
    assert len(model.feature_cache) == 2 and len(model.kv_cache) == 2  # prompt and negative prompt
    other = CacheKey.of("wan2.1-t2v-tiny", "vae", model.weights_versions["vae"], "x")
    model.feature_cache.put(other, torch.zeros(1))
    again = run(
        model, seed=1, num_inference_steps=1, prompt="a horse running"
    )  # new prompt, same negative prompt
    assert (again.metrics["text_cache_hits"], again.metrics["kv_cache_hits"]) == (1, 1)
    repeat = run(model, seed=1, num_inference_steps=1)
    assert (repeat.metrics["text_cache_hits"], repeat.metrics["kv_cache_hits"]) == (2, 2)
    assert torch.equal(first.outputs["frames"], repeat.outputs["frames"])

    assert model.set_weights_version("transformer", "t-2") == 3  # its 3 text K/V entries only
    assert len(model.feature_cache) == 4 and other in model.feature_cache
    assert run(model, seed=1, num_inference_steps=1).metrics["text_cache_hits"] == 2
    assert model.set_weights_version("text_encoder", "te-2") == 3 + 2  # its embeddings and K/V made from them
    assert other in model.feature_cache
    assert run(model, seed=1, num_inference_steps=1).metrics["text_cache_hits"] == 0


def test_cached_prompts_never_load_the_text_encoder(tiny_path):
    model = tiny_instance(tiny_path)
    run(model, num_inference_steps=1)
    model.release(keep={"tokenizer", "transformer", "vae"})
    assert run(model, num_inference_steps=1).metrics["text_cache_hits"] == 2
    assert "text_encoder" not in model.loaded()
