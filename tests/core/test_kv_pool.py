"""fv_core.kv.PagedKVPool: appends across pages equal one concatenation, forks share pages until a
write (copy-on-write), released pages return, a full pool refuses with a message, reservations promise
pages without taking them, gather pads rows."""

from __future__ import annotations

import pytest
import torch

from fv_core.kv import KVPoolFull, KVSeq, PagedKVPool


def tokens(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 3, n, 4, generator=g), torch.randn(2, 3, n, 4, generator=g)


def test_appends_across_pages_equal_one_concatenation():
    pool = PagedKVPool(2, 3, 4, page_size=4, num_pages=8)
    seq, ks, vs = KVSeq(), [], []
    for i, n in enumerate((3, 1, 6, 1)):
        k, v = tokens(n, i)
        seq = pool.append(seq, k, v)
        ks.append(k)
        vs.append(v)
    k, v = pool.read(seq)
    assert seq.length == 11 and len(seq.pages) == 3 and pool.used_pages == 3
    assert torch.equal(k, torch.cat(ks, 2)) and torch.equal(v, torch.cat(vs, 2))


def test_forks_share_pages_and_copy_on_write():
    pool = PagedKVPool(2, 3, 4, page_size=4, num_pages=8)
    prefix = pool.append(KVSeq(), *tokens(6, 0))  # one full page, one half page
    before = pool.read(prefix)
    a, b = pool.fork(prefix), pool.fork(prefix)
    a = pool.append(a, *tokens(3, 1))
    b = pool.append(b, *tokens(1, 2))
    assert a.pages[0] == b.pages[0] == prefix.pages[0]  # the full page is shared
    assert len({a.pages[1], b.pages[1], prefix.pages[1]}) == 3  # the half page was copied by each writer
    assert all(torch.equal(x, y) for x, y in zip(pool.read(prefix), before, strict=True))
    assert torch.equal(pool.read(a)[0][:, :, :6], before[0]) and torch.equal(
        pool.read(b)[0][:, :, :6], before[0]
    )
    for seq in (a, b, prefix):
        pool.release(seq)
    assert pool.used_pages == 0 and set(pool.refs) == {0}


def test_a_full_pool_refuses_and_keeps_what_it_had():
    pool = PagedKVPool(2, 3, 4, page_size=4, max_bytes=3 * 2 * 2 * 3 * 4 * 4 * 4)
    assert pool.num_pages == 3 and pool.nbytes == 3 * pool.page_bytes
    seq = pool.append(KVSeq(), *tokens(8, 0))
    with pytest.raises(KVPoolFull, match="all in use.*Fix"):
        pool.append(seq, *tokens(8, 1))
    assert pool.used_pages == 2  # the failed append took nothing
    with pytest.raises(ValueError, match="no page"):
        PagedKVPool(2, 3, 4, max_bytes=10)


def test_reservations_are_promises_within_the_pool():
    pool = PagedKVPool(2, 3, 4, page_size=4, num_pages=5)
    assert pool.reserve(3) and not pool.reserve(3) and pool.reserved_pages == 3  # a refusal takes nothing
    assert pool.reserve(2) and pool.used_pages == 0  # a promise allocates no page
    pool.unreserve(3)
    pool.unreserve(2)
    assert pool.reserved_pages == 0


def test_gather_pads_rows_and_marks_real_tokens():
    pool = PagedKVPool(2, 3, 4, page_size=4, num_pages=8)
    a = pool.append(KVSeq(), *tokens(5, 0))
    out = pool.gather([a, KVSeq()], 8)
    assert out["ctx_k"].shape == (2, 2, 3, 8, 4)
    assert out["ctx_valid"].tolist() == [[True] * 5 + [False] * 3, [False] * 8]
    assert torch.equal(out["ctx_k"][0, :, :, :5], pool.read(a)[0]) and not out["ctx_k"][0, :, :, 5:].any()


def test_a_pool_made_in_inference_mode_is_written_outside_it():
    with torch.inference_mode():
        pool = PagedKVPool(2, 3, 4, page_size=4, num_pages=2)
        seq = pool.append(KVSeq(), *tokens(2, 0))
    seq = pool.append(seq, *tokens(2, 1))
    assert seq.length == 4


def test_truncate_keeps_a_prefix_and_releases_the_rest():
    pool = PagedKVPool(2, 3, 4, page_size=4, num_pages=8)
    seq = pool.append(KVSeq(), *tokens(10, 0))
    cut = pool.truncate(seq, 5)
    assert cut.length == 5 and cut.pages == seq.pages[:2] and pool.used_pages == 2
    assert torch.equal(pool.read(cut)[0], pool.read(KVSeq(seq.pages, 10))[0][:, :, :5])


def test_layers_read_through_page_tables_equal_gather():
    pool = PagedKVPool(2, 3, 4, page_size=4, num_pages=8)
    a, b = pool.append(KVSeq(), *tokens(5, 0)), pool.append(KVSeq(), *tokens(2, 1))
    table = pool.table([a, b], 3)
    assert table["ctx_pages"].shape == (2, 3) and table["ctx_valid"].shape == (2, 12)
    padded = pool.gather([a, b], 12)
    # the pool's unwritten pages are uninitialised memory (NaN bit patterns too): compared as bits
    stored = pool.k.view(torch.int32).clone(), pool.v.view(torch.int32).clone()
    for layer in range(2):
        k, v = pool.layer(table["ctx_pages"], table["ctx_valid"], layer)
        assert torch.equal(k, padded["ctx_k"][:, layer]) and torch.equal(v, padded["ctx_v"][:, layer])
    # padding zeroed in the copy only
    assert torch.equal(pool.k.view(torch.int32), stored[0]) and torch.equal(
        pool.v.view(torch.int32), stored[1]
    )
    with pytest.raises(ValueError, match="table of 1 pages"):
        pool.table([a], 1)
