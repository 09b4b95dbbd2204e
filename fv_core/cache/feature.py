"""FeatureCache: an LRU of computed features (text embeddings, image latents) by CacheKey."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fv_core.cache.key import CacheKey


@dataclass(slots=True)
class CacheStats:
    """Counters since the cache was created."""

    hits: int = 0  # lookups answered from the cache
    misses: int = 0  # lookups that found nothing
    evictions: int = 0  # entries dropped by the LRU policy
    invalidations: int = 0  # entries dropped by invalidate()


class FeatureCache:
    """Thread-safe LRU keyed by CacheKey, invalidated by component or weights version."""

    def __init__(self, capacity: int = 256) -> None:
        if capacity < 1:
            raise ValueError(f"capacity={capacity} must be >= 1")
        self.capacity = capacity
        self.stats = CacheStats()
        self._entries: OrderedDict[CacheKey, Any] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: CacheKey) -> bool:
        return key in self._entries

    def get(self, key: CacheKey) -> Any | None:
        """The cached value (refreshing its LRU position), or None."""
        with self._lock:
            if key not in self._entries:
                self.stats.misses += 1
                return None
            self.stats.hits += 1
            self._entries.move_to_end(key)
            return self._entries[key]

    def put(self, key: CacheKey, value: Any) -> None:
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
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
                del self._entries[k]
            self.stats.invalidations += len(doomed)
            return len(doomed)
