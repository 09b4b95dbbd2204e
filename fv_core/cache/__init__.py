"""Caches that are correct by key: CacheKey, content hashing, FeatureCache (byte-budgeted), compact forms."""

from fv_core.cache.compact import RepeatedTail, fold_tail, tail_start, value_bytes
from fv_core.cache.feature import CacheStats, FeatureCache
from fv_core.cache.key import CacheKey, content_hash

__all__ = [
    "CacheKey",
    "CacheStats",
    "FeatureCache",
    "RepeatedTail",
    "content_hash",
    "fold_tail",
    "tail_start",
    "value_bytes",
]
