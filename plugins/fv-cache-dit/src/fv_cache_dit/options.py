"""Options of fv-cache-dit, named and meant as in the ``cache-dit`` package (``DBCacheConfig``).

A deploy file sets the defaults of an enabled interceptor; a request may
override any of them, and only them (the pydantic schema is the trust
boundary)::

    plugin_options:
      fv-cache-dit: {Fn_compute_blocks: 1, Bn_compute_blocks: 0, residual_diff_threshold: 0.3}
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

PLUGIN = "fv-cache-dit"


class CacheDiTOptions(BaseModel):
    """DBCache / FBCache / TaylorSeer settings; defaults are the package's."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    Fn_compute_blocks: int = Field(8, ge=1)  # first n blocks always run; their residual decides
    Bn_compute_blocks: int = Field(0, ge=0)  # last n blocks always run, refining a cached span
    residual_diff_threshold: float = Field(
        0.08, ge=0.0
    )  # cache while rel. L1 diff < this; 0 never, >=1 always
    max_warmup_steps: int = Field(8, ge=0)  # steps in range(0, this, warmup_interval) always compute
    warmup_interval: int = Field(1, ge=1)  # compute every n-th step during warmup
    max_cached_steps: int = Field(-1, ge=-1)  # at most this many cached steps per branch; -1: no limit
    max_continuous_cached_steps: int = Field(-1, ge=-1)  # at most this many in a row; -1: no limit
    max_accumulated_residual_diff_threshold: float | None = Field(None, gt=0.0)  # stop caching past this sum
    enable_taylorseer: bool = False  # forecast the cached residual with a Taylor series (TaylorSeer)
    taylorseer_order: int = Field(1, ge=1, le=2)  # derivatives kept by TaylorSeer
