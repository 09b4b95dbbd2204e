"""FeatureCache: an LRU of computed features (text embeddings, image latents) by CacheKey, bounded
by a byte budget (and an entry cap).

Bytes are what an entry keeps alive: a tensor counts its whole storage, so the
cache copies views of larger tensors before storing them (it never pins a
batch's output through one row). ``pack`` / ``unpack`` give an entry a compact
stored form (e.g. :func:`~fv_core.cache.compact.fold_tail`); bytes count the
stored form. An entry larger than the whole budget is not stored.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fv_core.cache.compact import own_storage, value_bytes
from fv_core.cache.key import CacheKey


@dataclass(slots=True)
class CacheStats:
    """Counters since the cache was created."""

    hits: int = 0  # lookups answered from the cache
    misses: int = 0  # lookups that found nothing
    evictions: int = 0  # entries dropped by the LRU policy (entry cap or byte budget)
    invalidations: int = 0  # entries dropped by invalidate()
    rejected: int = 0  # puts not stored: the entry alone exceeds max_bytes


class FeatureCache:
    """Thread-safe LRU keyed by CacheKey, invalidated by component or weights version.

    :param capacity: most entries held.
    :param max_bytes: most bytes held (``None``: entries only bound it); see :attr:`nbytes`.
    :param pack: stored form of a value (default: the value, views copied to their own storage).
    :param unpack: the value of a stored form (default: the stored form).
    """

    def __init__(
        self,
        capacity: int = 256,
        max_bytes: int | None = None,
        *,
        pack: Callable[[Any], Any] = own_storage,
        unpack: Callable[[Any], Any] = lambda stored: stored,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity={capacity} must be >= 1 entry")
        if max_bytes is not None and max_bytes < 1:
            raise ValueError(f"max_bytes={max_bytes} must be >= 1 (or None for no byte budget)")
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.stats = CacheStats()
        self.nbytes = 0  # bytes the stored entries keep alive
        self._pack, self._unpack = pack, unpack
        self._entries: OrderedDict[CacheKey, tuple[Any, int]] = OrderedDict()  # key -> (stored, bytes)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: CacheKey) -> bool:
        return key in self._entries

    def keys(self) -> list[CacheKey]:
        """The cached keys, least recently used first."""
        with self._lock:
            return list(self._entries)

    def get(self, key: CacheKey, *, packed: bool = False) -> Any | None:
        """The cached value (``packed``: its stored form) refreshing its LRU position, or None."""
        with self._lock:
            if key not in self._entries:
                self.stats.misses += 1
                return None
            self.stats.hits += 1
            self._entries.move_to_end(key)
            stored = self._entries[key][0]
        return stored if packed else self._unpack(stored)

    def put(self, key: CacheKey, value: Any) -> None:
        stored = self._pack(value)
        size = value_bytes(stored)
        with self._lock:
            self._drop(key)
            if self.max_bytes is not None and size > self.max_bytes:
                self.stats.rejected += 1
                return
            self._entries[key] = (stored, size)
            self.nbytes += size
            while len(self._entries) > self.capacity or (
                self.max_bytes is not None and self.nbytes > self.max_bytes
            ):
                _, (_, dropped) = self._entries.popitem(last=False)
                self.nbytes -= dropped
                self.stats.evictions += 1

    def get_or_compute(self, key: CacheKey, compute: Callable[[], Any]) -> Any:
        """The cached value, or ``compute()`` stored under ``key`` (computed outside the lock)."""
        value = self.get(key)
        if value is None:
            value = compute()
            self.put(key, value)
        return value

    def invalidate(
        self, *, model: str | None = None, component: str | None = None, weights_version: str | None = None
    ) -> int:
        """Drop entries matching every given field (all entries if none given); returns how many."""
        with self._lock:
            doomed = [
                k
                for k in self._entries
                if (model is None or k.model == model)
                and (component is None or k.component == component)
                and (weights_version is None or k.weights_version == weights_version)
            ]
            for k in doomed:
                self._drop(k)
            self.stats.invalidations += len(doomed)
            return len(doomed)

    def _drop(self, key: CacheKey) -> None:
        """Remove ``key`` if present (caller holds the lock)."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.nbytes -= entry[1]
