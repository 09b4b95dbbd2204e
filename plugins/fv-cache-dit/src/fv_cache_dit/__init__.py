"""fv plugin: DBCache / FBCache / TaylorSeer block interceptors with per-request state."""

from fv_cache_dit.dbcache import DBCache, FBCache, TaylorSeer
from fv_cache_dit.options import PLUGIN, CacheDiTOptions
from fv_cache_dit.stats import summarize

__all__ = ["PLUGIN", "CacheDiTOptions", "DBCache", "FBCache", "TaylorSeer", "summarize"]
