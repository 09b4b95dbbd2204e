"""Caches that are correct by key: CacheKey, content hashing, FeatureCache."""

from fv_core.cache.feature import CacheStats, FeatureCache
from fv_core.cache.key import CacheKey, content_hash

__all__ = ["CacheKey", "CacheStats", "FeatureCache", "content_hash"]
