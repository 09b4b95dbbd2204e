"""A paged key/value pool: fixed-size pages of every layer's keys and values, allocated to token
sequences under one byte budget (vLLM's paged attention storage, without its kernels).

A sequence is a :class:`KVSeq`: the ids of its pages and its length, plain data that lives in the
request's ``LoopState``. The pool owns the storage and one reference count per page:

- ``append`` writes new tokens after a sequence's last one, taking pages from the free list; a
  partly filled last page that another sequence shares is copied first (copy-on-write), so a write
  never changes what another sequence reads;
- ``fork`` makes a second sequence over the same pages (a shared prefix: CFG contexts, a system
  prompt) without copying them;
- ``release`` drops a sequence's references; pages nobody references return to the free list;
- ``truncate`` cuts a sequence to its first tokens (a shorter prefix of the same pages);
- ``gather`` copies sequences into step inputs padded to one length, with a mask of real tokens, so a
  step body stays a pure function of its inputs; or ``table`` gives rows' page tables, and a body reads
  one layer at a time through them (``layer``): no padded copy of every layer's context per step.

The pool's storage is allocated once (``nbytes``), so an instance that holds one reports it in its
resident bytes. Its pages are a budget of their own: admission ``reserve``s each request's worst case
before the request runs and ``unreserve``s it when the request leaves, so admitted requests never run
out of pages; the count lives on the pool, shared by every engine that admits onto it. Running out of
pages (a writer that reserved nothing, or less than it wrote) raises :class:`KVPoolFull`.

Pages kept for later requests (a :class:`~fv_core.kv.prefix.PrefixCache` holds one reference on each)
are not promised to anyone: when the free list runs dry, the pool asks its ``reclaim`` callback (the
cache's eviction of unreferenced prefixes) for pages before it refuses.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from fv_core.errors import FvError


class KVPoolFull(FvError, MemoryError):
    """No free page is left for a sequence's new tokens."""


@dataclass(slots=True)
class KVSeq:
    """One token sequence in a pool: its pages in order and how many tokens it holds."""

    pages: list[int] = field(default_factory=list)  # page ids, in token order
    length: int = 0  # tokens written


class PagedKVPool:
    """Pages of ``[layers, kv_heads, page_size, head_dim]`` keys and values.

    :param num_pages: pages in the pool; or ``max_bytes``: as many as fit (keys and values together).
    """

    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        *,
        page_size: int = 16,
        num_pages: int | None = None,
        max_bytes: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        self.page_size = page_size
        self.page_bytes = (
            2 * layers * kv_heads * page_size * head_dim * torch.empty((), dtype=dtype).element_size()
        )
        if num_pages is None:
            if max_bytes is None:
                raise ValueError("PagedKVPool needs num_pages or max_bytes")
            num_pages = max_bytes // self.page_bytes
        if num_pages < 1:
            raise ValueError(
                f"a KV pool of {max_bytes} bytes holds no page of {self.page_bytes} bytes. Fix: give it more bytes"
            )
        shape = (num_pages, layers, kv_heads, page_size, head_dim)
        # writable in and out of inference mode; uninitialized (only written tokens are ever read), so
        # untouched pages cost no resident memory on a host that allocates lazily
        with torch.inference_mode(False), torch.no_grad():
            self.k = torch.empty(shape, dtype=dtype, device=device)
            self.v = torch.empty(shape, dtype=dtype, device=device)
        self.refs = [0] * num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out the lowest id first
        self.reserved_pages = 0  # pages admission promised to admitted requests (their worst case)
        self.reclaim: Callable[[], bool] | None = None  # frees one held-but-unused page (a cache's eviction)
        self.lock = threading.RLock()  # the pool's and its cache's state (a cache evicts under it)

    @property
    def num_pages(self) -> int:
        return len(self.refs)

    @property
    def nbytes(self) -> int:
        """Bytes of the pool's storage (allocated up front)."""
        return self.num_pages * self.page_bytes

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._free)

    def drain(self) -> int:
        """Evict what a cache keeps only for later requests (``reclaim`` until it frees nothing more);
        returns the pages still in use (held by sequences: 0 once every request gave its pages back)."""
        with self.lock:
            while self.reclaim is not None and self.reclaim():
                pass
            return self.used_pages

    def pages_for(self, tokens: int) -> int:
        """Pages a sequence of ``tokens`` tokens holds."""
        return -(-tokens // self.page_size)

    def reserve(self, pages: int) -> bool:
        """Promise ``pages`` more pages if the promises fit the pool, else False (nothing reserved)."""
        with self.lock:
            if self.reserved_pages + pages > self.num_pages:
                return False
            self.reserved_pages += pages
            return True

    def unreserve(self, pages: int) -> None:
        """Take back a promise of ``pages`` pages (its request left)."""
        with self.lock:
            self.reserved_pages -= pages

    def _take(self) -> int:
        while not self._free and self.reclaim is not None and self.reclaim():
            pass
        if not self._free:
            raise KVPoolFull(
                f"the KV pool's {self.num_pages} pages of {self.page_size} tokens ({self.nbytes} bytes) are all in "
                "use. Fix: run fewer or shorter requests at once, or give the pool more bytes."
            )
        page = self._free.pop()
        self.refs[page] = 1
        return page

    def _drop(self, page: int) -> None:
        self.refs[page] -= 1
        if self.refs[page] == 0:
            self._free.append(page)

    def hold(self, pages: list[int]) -> None:
        """One more reference on each of ``pages`` (a holder that is not a sequence: a prefix cache)."""
        with self.lock:
            for page in pages:
                self.refs[page] += 1

    def drop(self, pages: list[int]) -> None:
        """Give back references taken by :meth:`hold` (pages nobody references return to the free list)."""
        with self.lock:
            for page in pages:
                self._drop(page)

    def append(self, seq: KVSeq, k: torch.Tensor, v: torch.Tensor) -> KVSeq:
        """``seq`` with tokens ``k``, ``v`` (``[layers, kv_heads, T, head_dim]``) written after its last one."""
        with self.lock:
            pages, length, total = list(seq.pages), seq.length, k.shape[2]
            taken: list[int] = []
            try:
                if length % self.page_size and self.refs[pages[-1]] > 1:  # shared, partly filled: copy it
                    page = self._take()
                    taken.append(page)
                    self.k[page].copy_(self.k[pages[-1]])
                    self.v[page].copy_(self.v[pages[-1]])
                    self._drop(pages[-1])
                    pages[-1] = page
                while len(pages) < self.pages_for(length + total):
                    pages.append(self._take())
                    taken.append(pages[-1])
            except KVPoolFull:
                for page in taken:
                    self._drop(page)
                raise
            written = 0
            while written < total:
                page, offset = (
                    pages[(length + written) // self.page_size],
                    (length + written) % self.page_size,
                )
                n = min(self.page_size - offset, total - written)
                self.k[page, :, :, offset : offset + n] = k[:, :, written : written + n]
                self.v[page, :, :, offset : offset + n] = v[:, :, written : written + n]
                written += n
            return KVSeq(pages, length + total)

    def fork(self, seq: KVSeq) -> KVSeq:
        """A second sequence over ``seq``'s pages (no copy until one of them writes to a shared page)."""
        with self.lock:
            for page in seq.pages:
                self.refs[page] += 1
            return KVSeq(list(seq.pages), seq.length)

    def truncate(self, seq: KVSeq, length: int) -> KVSeq:
        """``seq`` cut to its first ``length`` tokens (its pages past them released)."""
        if not 0 <= length <= seq.length:
            raise ValueError(f"truncate to {length} tokens, but the sequence holds {seq.length}")
        keep = self.pages_for(length)
        self.drop(seq.pages[keep:])
        return KVSeq(list(seq.pages[:keep]), length)

    def release(self, seq: KVSeq) -> None:
        """Drop ``seq``'s references (its pages return to the pool when no other sequence holds them)."""
        self.drop(seq.pages)

    def read(self, seq: KVSeq) -> tuple[torch.Tensor, torch.Tensor]:
        """``seq``'s keys and values, ``[layers, kv_heads, length, head_dim]`` each (a copy)."""
        k = self.k[seq.pages].permute(1, 2, 0, 3, 4).flatten(2, 3)[:, :, : seq.length]
        v = self.v[seq.pages].permute(1, 2, 0, 3, 4).flatten(2, 3)[:, :, : seq.length]
        return k, v

    def table(self, seqs: list[KVSeq], pages: int) -> dict[str, torch.Tensor]:
        """Rows' page tables ``ctx_pages`` ``[rows, pages]`` (page ids; past a sequence's pages: page 0, never
        read) and ``ctx_valid`` ``[rows, pages * page_size]`` (True on real tokens), for :meth:`layer`."""
        if any(len(s.pages) > pages for s in seqs):
            raise ValueError(
                f"a table of {pages} pages, but a sequence holds {max(len(s.pages) for s in seqs)}"
            )
        table = torch.tensor([s.pages + [0] * (pages - len(s.pages)) for s in seqs], dtype=torch.long)
        lengths = torch.tensor([s.length for s in seqs])
        valid = torch.arange(pages * self.page_size)[None] < lengths[:, None]
        return {"ctx_pages": table.to(self.k.device), "ctx_valid": valid.to(self.k.device)}

    def layer(
        self, pages: torch.Tensor, valid: torch.Tensor, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's keys and values of rows read through their page tables (:meth:`table`):
        ``[rows, kv_heads, pages * page_size, head_dim]`` each, zero past each row's real tokens."""
        rows, n = pages.shape
        _, _, kvh, size, d = self.k.shape
        hide = ~valid[:, None, :, None]
        # indexing copies the pages out of the pool, so the padding is zeroed in that copy, in place
        k = self.k[pages, layer].permute(0, 2, 1, 3, 4).reshape(rows, kvh, n * size, d).masked_fill_(hide, 0)
        v = self.v[pages, layer].permute(0, 2, 1, 3, 4).reshape(rows, kvh, n * size, d).masked_fill_(hide, 0)
        return k, v

    def gather(self, seqs: list[KVSeq], size: int) -> dict[str, torch.Tensor]:
        """Rows of step inputs: ``ctx_k`` / ``ctx_v`` ``[rows, layers, kv_heads, size, head_dim]`` (zero past each
        sequence's length) and ``ctx_valid`` ``[rows, size]`` (True on real tokens)."""
        if any(s.length > size for s in seqs):
            raise ValueError(f"gather to {size} tokens, but a sequence holds {max(s.length for s in seqs)}")
        _, layers, kvh, _, d = self.k.shape
        out_k = self.k.new_zeros(len(seqs), layers, kvh, size, d)
        out_v = self.v.new_zeros(len(seqs), layers, kvh, size, d)
        for row, seq in enumerate(seqs):
            if seq.length:
                k, v = self.read(seq)
                out_k[row, :, :, : seq.length], out_v[row, :, :, : seq.length] = k, v
        valid = (
            torch.arange(size, device=self.k.device)[None]
            < torch.tensor([s.length for s in seqs], device=self.k.device)[:, None]
        )
        return {"ctx_k": out_k, "ctx_v": out_v, "ctx_valid": valid}
