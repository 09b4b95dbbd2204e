"""FeatureCache byte budget: eviction by bytes, views stored without their base, lossless compact
forms, the card contract's validation, and admission reserving an instance's cache budget."""

import pytest
import torch
from pydantic import ValidationError

from fv_core.cache import CacheKey, FeatureCache, fold_tail, value_bytes
from fv_core.card import CacheContract
from fv_core.errors import AdmissionInfeasible
from fv_core.runtime import AdmissionController, Budget, Estimate


def key(i: int) -> CacheKey:
    return CacheKey.of("m", "text_encoder", "v1", f"prompt {i}")


def floats(n: int, fill: float = 0.0) -> torch.Tensor:
    return torch.full((n,), float(fill))  # 4 n bytes


def test_evicts_least_recent_until_the_bytes_fit():
    cache = FeatureCache(capacity=100, max_bytes=1000)
    for i in range(3):
        cache.put(key(i), floats(100, i))  # 400 bytes each
    assert len(cache) == 2 and cache.nbytes == 800 and key(0) not in cache
    cache.get(key(1))  # 1 is now the most recent
    cache.put(key(3), floats(60))
    assert cache.nbytes == 640 and key(2) not in cache and key(1) in cache
    assert cache.stats.evictions == 2
    cache.put(key(1), floats(10))  # replacing an entry recounts it
    assert cache.nbytes == 280
    assert cache.invalidate() == 2 and cache.nbytes == 0


def test_an_entry_over_the_whole_budget_is_not_stored():
    cache = FeatureCache(max_bytes=100)
    cache.put(key(0), floats(10))
    cache.put(key(1), floats(26))  # 104 bytes
    assert key(1) not in cache and key(0) in cache and cache.stats.rejected == 1 and cache.nbytes == 40


def test_a_row_of_a_batch_is_stored_without_the_batch():
    batch = torch.randn(16, 256)
    cache = FeatureCache()
    cache.put(key(0), batch[3])
    assert cache.nbytes == 256 * 4  # not the 16-row base a view would pin
    assert torch.equal(cache.get(key(0)), batch[3])
    assert value_bytes([batch[0], batch[1]]) == batch.nbytes  # one storage counted once


def test_entry_cap_still_applies_with_a_byte_budget():
    cache = FeatureCache(capacity=2, max_bytes=1 << 20)
    for i in range(3):
        cache.put(key(i), floats(1))
    assert len(cache) == 2 and cache.nbytes == 8


def test_fold_tail_is_bit_exact_and_stores_the_run_once():
    x = torch.randn(3, 2, 40, 8)
    x[:, :, 5:] = x[:, :, 5:6]  # padding rows: all equal
    folded = fold_tail(x, -2)
    assert folded.head.shape == (3, 2, 6, 8) and folded.nbytes == x.nbytes * 6 // 40
    assert torch.equal(folded.expand().view(torch.int32), x.view(torch.int32))
    y = x.clone()
    y[1, 0, 30, 2] = -0.0 if y[1, 0, 30, 2] == 0 else y[1, 0, 30, 2] + 1  # one row differs in one block
    assert fold_tail(y, -2).head.shape[-2] == 32
    assert torch.equal(fold_tail(y, -2).expand(), y)


def test_fold_tail_tells_signed_zeros_apart():
    x = torch.zeros(4, 3)
    x[1] = -0.0  # == 0.0 numerically, different bits
    restored = fold_tail(x, 0).expand()
    assert torch.equal(restored.view(torch.int32), x.view(torch.int32))


def test_cache_with_a_compact_form_counts_the_compact_bytes():
    x = torch.randn(64, 16)
    x[4:] = x[4]
    cache = FeatureCache(max_bytes=10_000, pack=lambda t: fold_tail(t, 0), unpack=lambda f: f.expand())
    cache.put(key(0), x)
    assert cache.nbytes == 5 * 16 * 4
    assert torch.equal(cache.get(key(0)), x)


def test_cache_contract_validates_its_bounds():
    assert CacheContract(kind="kv", key_fields=["model"]).max_bytes == 64 << 20
    assert CacheContract(kind="kv", key_fields=["model"], max_bytes=None).max_bytes is None
    for bad in ({"max_bytes": 0}, {"capacity": 0}):
        with pytest.raises(ValidationError):
            CacheContract(kind="kv", key_fields=["model"], **bad)
    with pytest.raises(ValueError, match="max_bytes=0 must be >= 1"):
        FeatureCache(max_bytes=0)


class CachedInstance:
    """An instance whose resident bytes are its weights plus its cache's budget (as WanModel's are)."""

    def __init__(self, cache: FeatureCache, weights: int) -> None:
        self.cache, self.weights = cache, weights

    def resident_bytes(self) -> int:
        return self.weights + (self.cache.max_bytes or self.cache.nbytes)


def test_admission_reserves_the_cache_budget():
    inst = CachedInstance(FeatureCache(max_bytes=4000), weights=1000)
    admission = AdmissionController(Budget(memory_bytes=5500))
    need = Estimate(compute_s=0.0, peak_bytes=600)
    with pytest.raises(AdmissionInfeasible, match="memory needs 5000 resident"):
        admission.check_feasible("r", need, inst)
    assert admission.try_reserve("r", Estimate(0.0, 500), inst) is not None
    assert admission.memory_bytes == 5500
