"""Paged key/value storage for loops that cache attention keys and values (AR decode, prefix reuse)."""

from fv_core.kv.pool import KVPoolFull, KVSeq, PagedKVPool
from fv_core.kv.prefix import PrefixCache, PrefixStats, common_prefix_length

__all__ = ["KVPoolFull", "KVSeq", "PagedKVPool", "PrefixCache", "PrefixStats", "common_prefix_length"]
