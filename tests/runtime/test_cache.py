"""CacheKey and FeatureCache: correct by key, LRU, invalidation by component / version."""

import torch

from fv_core.cache import CacheKey, FeatureCache, content_hash


def test_content_hash_covers_dtype_shape_and_values():
    x = torch.arange(4.0)
    assert content_hash(x) == content_hash(x.clone())
    assert (
        len({content_hash(x), content_hash(x.double()), content_hash(x.reshape(2, 2)), content_hash(x + 1)})
        == 4
    )
    assert content_hash("ab", "c") != content_hash("a", "bc")
    assert content_hash(torch.tensor(1.0, dtype=torch.bfloat16)) != content_hash(torch.tensor(1.0))
    # any strides hash by value: an expanded scalar (stride 0; torch calls it contiguous), a transpose
    assert content_hash(torch.tensor(5.0).expand(1)) == content_hash(torch.tensor([5.0]))
    assert content_hash(x.reshape(2, 2).t()) == content_hash(x.reshape(2, 2).t().contiguous())


def test_cache_key_extra_fields_are_order_free_and_output_semantic():
    a = CacheKey.of("wan", "text_encoder", "v1", "a cat", precision="bf16", max_len=512)
    b = CacheKey.of("wan", "text_encoder", "v1", "a cat", max_len=512, precision="bf16")
    c = CacheKey.of("wan", "text_encoder", "v1", "a cat", max_len=256, precision="bf16")
    assert a == b and hash(a) == hash(b) and a != c


def test_feature_cache_lru_stats_and_invalidation():
    cache = FeatureCache(capacity=2)
    te1 = CacheKey.of("wan", "text_encoder", "v1", "p1")
    te2 = CacheKey.of("wan", "text_encoder", "v1", "p2")
    dit = CacheKey.of("wan", "transformer", "v7", "p1")
    calls = []
    assert cache.get_or_compute(te1, lambda: calls.append(1) or "e1") == "e1"
    assert cache.get_or_compute(te1, lambda: calls.append(1) or "again") == "e1"
    cache.put(te2, "e2")
    cache.get(te1)  # te1 now most recent
    cache.put(dit, "d")  # evicts te2
    assert te2 not in cache and te1 in cache and len(calls) == 1
    assert (cache.stats.hits, cache.stats.misses, cache.stats.evictions) == (2, 1, 1)
    assert cache.invalidate(component="transformer", weights_version="v7") == 1  # a DiT sync keeps embeddings
    assert te1 in cache and dit not in cache
    assert cache.invalidate() == 1 and len(cache) == 0
