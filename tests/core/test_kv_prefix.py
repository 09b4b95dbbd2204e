"""fv_core.kv.PrefixCache: sequences sharing a prefix share its pages (full pages as they are, a page
matched up to its first differing token copied on the first write), namespaces never share, unreferenced
prefixes are evicted least recently used first when the pool runs out, and pages come back."""

from __future__ import annotations

import pytest
import torch

from fv_core.kv import KVPoolFull, KVSeq, PagedKVPool, PrefixCache


def tokens(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 3, n, 4, generator=g), torch.randn(2, 3, n, 4, generator=g)


def written(pool: PagedKVPool, n: int, seed: int) -> KVSeq:
    return pool.append(KVSeq(), *tokens(n, seed))


def test_a_shared_prefix_is_served_from_its_pages_and_copied_on_write():
    pool = PagedKVPool(2, 3, 4, page_size=4, num_pages=16)
    cache = PrefixCache(pool)
    keys = list(range(10))  # two full pages and a half page
    seq = written(pool, 10, 0)
    cache.insert("v1", keys, seq)
    before = pool.read(seq)
    pool.release(seq)
    assert pool.used_pages == 3 == cache.cached_pages  # kept for later requests

    same = cache.lookup("v1", keys + [99, 98])
    assert same.length == 10 and same.pages == seq.pages
    longer = pool.append(same, *tokens(2, 1))  # the half page is shared: copied, never overwritten
    assert longer.pages[:2] == seq.pages[:2] and longer.pages[2] != seq.pages[2]
    assert all(torch.equal(a, b) for a, b in zip(pool.read(KVSeq(seq.pages, 10)), before, strict=True))

    differs = cache.lookup("v1", [0, 1, 2, 3, 4, 5, 77, 7])  # first difference inside the second page
    assert differs.length == 6 and differs.pages == seq.pages[:2]
    assert cache.lookup("v2", keys).length == 0  # another weights version never shares
    assert cache.lookup("v1", [5, 1]).length == 0
    assert cache.stats.lookups == 4 and cache.stats.hits == 2 and cache.stats.matched_tokens == 16
    for s in (longer, differs):
        pool.release(s)
    assert cache.clear() == 3 and pool.used_pages == 0 and set(pool.refs) == {0}


def test_a_longer_partial_page_replaces_the_shorter_one():
    pool = PagedKVPool(2, 3, 4, page_size=4, num_pages=8)
    cache = PrefixCache(pool)
    short = written(pool, 6, 0)
    cache.insert("v", list(range(6)), short)
    longer = pool.append(pool.fork(short), *tokens(1, 1))  # copies the half page
    cache.insert("v", list(range(7)), longer)
    pool.release(short)
    pool.release(longer)
    assert cache.cached_pages == 2 and pool.used_pages == 2  # the 2-token page was dropped
    hit = cache.lookup("v", list(range(7)))
    assert hit.length == 7 and hit.pages == longer.pages
    pool.release(hit)


def test_the_pool_evicts_least_recently_used_unreferenced_prefixes():
    pool = PagedKVPool(2, 3, 4, page_size=4, num_pages=4)
    cache = PrefixCache(pool)
    for name, seed in (("a", 0), ("b", 1)):
        seq = written(pool, 8, seed)
        cache.insert("v", [name] * 4 + list(range(4)), seq)
        pool.release(seq)
    held = cache.lookup("v", ["b"] * 4 + list(range(4)))  # b is in use (and the most recent)
    assert held.length == 8 and pool.used_pages == 4
    fresh = written(pool, 8, 2)  # needs 2 pages: a's, the least recent, unreferenced, are evicted
    assert cache.stats.evicted_pages == 2 and cache.lookup("v", ["a"] * 4).length == 0
    with pytest.raises(KVPoolFull):  # b's pages are referenced: never evicted
        written(pool, 4, 3)
    assert cache.lookup("v", ["b"] * 4 + list(range(4))).pages == held.pages
    pool.release(fresh)


def test_insert_needs_a_key_per_token():
    pool = PagedKVPool(2, 3, 4, page_size=4, num_pages=4)
    with pytest.raises(ValueError, match="one key per token"):
        PrefixCache(pool).insert("v", [1, 2], written(pool, 3, 0))
    with pytest.raises(ValueError, match="truncate to 5"):
        pool.truncate(written(pool, 3, 1), 5)


def test_a_second_copy_of_a_cached_prefix_adds_nothing_and_all_stays_evictable():
    pool = PagedKVPool(2, 3, 4, page_size=4, num_pages=8)
    cache = PrefixCache(pool)
    first, second = written(pool, 6, 0), written(pool, 8, 1)  # prefilled side by side: two copies
    cache.insert("v", list(range(6)), first)
    cache.insert("v", list(range(8)), second)  # its first page is another copy: nothing added past it
    assert cache.pages() == set(first.pages)
    pool.release(first)
    assert pool.drain() == len(second.pages)  # the cache's own pages went back; the sequence's stay
    pool.release(second)
    assert pool.drain() == 0


def test_match_measures_what_a_lookup_would_serve_and_takes_nothing():
    pool = PagedKVPool(2, 3, 4, page_size=4, num_pages=8)
    cache = PrefixCache(pool)
    seq = written(pool, 10, 0)
    cache.insert("v1", list(range(10)), seq)
    pool.release(seq)
    refs = list(pool.refs)
    for keys in (list(range(12)), [0, 1, 2, 3, 4, 5, 77], [0, 1, 9], [5], []):
        n = cache.match("v1", keys)
        assert pool.refs == refs and cache.stats.lookups == 0
        served = cache.lookup("v1", keys)
        assert served.length == n
        pool.release(served)
        cache.stats.lookups = 0
    assert cache.match("v2", list(range(10))) == 0
