"""DBCache (and FBCache, its ``F1B0`` case) as an fv block interceptor.

One forward of one CFG branch at its ``step``-th call::

    blocks [0, Fn)          always run; their residual r = h_Fn - h_0 is compared with
                            the one of the last computed step: diff = mean|r' - r| / mean|r'|
    blocks [Fn, N - Bn)     run, or skipped when the step may cache and diff < threshold:
                            the span's cached residual (or its TaylorSeer forecast) is added
    blocks [N - Bn, N)      always run

A step may cache unless it is a warmup step, the branch has cached
``max_cached_steps`` steps (or ``max_continuous_cached_steps`` in a row), or
the accumulated diff passed ``max_accumulated_residual_diff_threshold``.
Everything per request lives in ``plugin_state["fv-cache-dit"]``: the
request's resolved options under ``"options"`` and one cache dict per CFG
branch (``"cond"``, ``"uncond"``, ``"main"``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from pydantic import ValidationError

from fv_cache_dit.options import PLUGIN, CacheDiTOptions
from fv_cache_dit.stats import summarize
from fv_cache_dit.taylorseer import taylor_forecast, taylor_update
from fv_core import ConfigError, explain
from fv_core.extend import BLOCK_SKIP, BlockFn, BlockHook, BlockHooks, drive_spans
from fv_core.loop import LoopResult, LoopState
from fv_core.parallel import global_mean


def rel_l1(prev: torch.Tensor, curr: torch.Tensor) -> float:
    """``mean|prev - curr| / mean|prev|``: the package's residual difference (over the whole forward
    when a parallel group holds it in pieces, so every rank makes the same decision)."""
    return (global_mean((prev - curr).abs()) / global_mean(prev.abs())).item()


def may_cache(opts: CacheDiTOptions, cache: dict[str, Any], step: int, streak: int) -> bool:
    """Whether ``step`` may use the cache at all, before looking at the residual difference."""
    if step in range(0, opts.max_warmup_steps, opts.warmup_interval):
        return False
    if 0 <= opts.max_cached_steps <= len(cache.get("cached_steps", [])):
        return False
    if 0 <= opts.max_continuous_cached_steps <= streak:
        return False
    limit = opts.max_accumulated_residual_diff_threshold
    return not (limit is not None and cache.get("accumulated_diff", 0.0) >= limit)


def similar(opts: CacheDiTOptions, cache: dict[str, Any], residual: torch.Tensor) -> bool:
    """Compare ``residual`` with the last computed step's; records the difference."""
    threshold, prev = opts.residual_diff_threshold, cache.get("Fn_residual")
    if threshold <= 0.0 or prev is None:
        return False
    if threshold >= 1.0:  # the package's "always cache"
        return True
    diff = rel_l1(prev, residual)
    cache["residual_diffs"] = {**cache.get("residual_diffs", {}), str(cache["step"]): diff}
    cache["accumulated_diff"] = cache.get("accumulated_diff", 0.0) + max(diff, 0.0)
    return diff < threshold


class DBCache:
    """Dual Block Cache: ``Fn`` blocks in front decide, ``Bn`` behind refine, the middle span is cached."""

    plugin_id: ClassVar[str] = PLUGIN
    kind: ClassVar[str] = BLOCK_SKIP
    name: ClassVar[str] = "dbcache"
    preset: ClassVar[dict[str, Any]] = {}  # option defaults this variant changes

    def __init__(self, **options: Any) -> None:
        """``options``: this interceptor's own defaults (over the package's and this variant's preset);
        a deployment's and a request's options reach each request through ``request.options``."""
        try:
            self.options = CacheDiTOptions(**{**self.preset, **options})
        except ValidationError as exc:
            raise ConfigError(
                explain(exc, f"interceptor {self.name!r}", CacheDiTOptions.model_fields)
            ) from None

    def check_request(self, request: Any, instance: Any) -> None:
        """Refuse, before the request is queued, options the model cannot run (more compute blocks than
        its transformer has)."""
        blocks = getattr(instance, "num_blocks", None)
        opts = self._options(request)
        if blocks is not None and opts.Fn_compute_blocks + opts.Bn_compute_blocks > blocks:
            raise ConfigError(
                f"{self.name}: Fn_compute_blocks={opts.Fn_compute_blocks} + Bn_compute_blocks="
                f"{opts.Bn_compute_blocks} exceed the model's {blocks} blocks. Fix: choose Fn + Bn <= {blocks}.",
                param="plugin_options",
            )

    def _options(self, request: Any) -> CacheDiTOptions:
        asked = request.options.get(PLUGIN) if request.options else None
        update = asked.model_dump(include=asked.model_fields_set) if asked is not None else {}
        return self.options.model_copy(update=update)

    def on_start(self, state: LoopState, request: Any) -> None:
        """This request's options: the fields its (core-validated) options set, over this interceptor's."""
        asked = request.options.get(PLUGIN) if request.options else None
        update = asked.model_dump(include=asked.model_fields_set) if asked is not None else {}
        state.plugin_state.setdefault(PLUGIN, {})["options"] = self.options.model_copy(
            update=update
        ).model_dump()

    def on_finish(self, state: LoopState, result: LoopResult) -> None:
        result.metrics["cache_dit"] = summarize(self.name, state.plugin_state.get(PLUGIN, {}))

    # -- the block seam: one forward of one CFG branch, for a request alone or for its rows of a batch --

    def run_blocks(
        self,
        caches: dict[str, dict[str, Any]],
        branch: str,
        hidden: torch.Tensor,
        num_blocks: int,
        block: BlockFn,
    ) -> torch.Tensor:
        """The request's forward alone: the span driver with this request as the only rows."""
        return drive_spans(
            BlockHooks([(BlockHook(self, caches), hidden.shape[0])]), branch, hidden, num_blocks, block
        )

    def begin_span(self, caches: dict[str, dict[str, Any]], branch: str, num_blocks: int) -> tuple[int, int]:
        """Count the branch's call; the span ``[Fn, num_blocks - Bn)`` is the one that may be cached."""
        opts = CacheDiTOptions.model_validate(caches["options"])
        fn, bn = opts.Fn_compute_blocks, opts.Bn_compute_blocks
        if fn + bn > num_blocks:
            raise ConfigError(
                f"{self.name}: Fn_compute_blocks={fn} + Bn_compute_blocks={bn} exceed the model's "
                f"{num_blocks} blocks. Fix: choose Fn + Bn <= {num_blocks}."
            )
        cache = caches.setdefault(branch, {})
        cache["step"] = cache.get("step", -1) + 1
        return fn, num_blocks - bn

    def skip_span(
        self, caches: dict[str, dict[str, Any]], branch: str, residual: torch.Tensor
    ) -> torch.Tensor | None:
        """The span's cached residual (or its TaylorSeer forecast) when this step may cache and the
        front blocks' ``residual`` is close to the last computed step's; None: run the span."""
        opts, cache = CacheDiTOptions.model_validate(caches["options"]), caches[branch]
        step, cached_steps = cache["step"], cache.get("cached_steps", [])
        streak = cache.get("streak", 0) if cached_steps and cached_steps[-1] == step - 1 else 0
        if may_cache(opts, cache, step, streak) and similar(opts, cache, residual):
            cache["cached_steps"], cache["streak"] = [*cached_steps, step], streak + 1
            return taylor_forecast(cache, step) if opts.enable_taylorseer else cache["Bn_residual"]
        cache["Fn_residual"], cache["streak"] = residual, streak
        return None

    def end_span(self, caches: dict[str, dict[str, Any]], branch: str, residual: torch.Tensor) -> None:
        """Record the residual of the span just computed."""
        opts, cache = CacheDiTOptions.model_validate(caches["options"]), caches[branch]
        if opts.enable_taylorseer:
            taylor_update(cache, cache["step"], residual, opts.taylorseer_order)
        else:
            cache["Bn_residual"] = residual


class FBCache(DBCache):
    """First Block Cache: DBCache with ``Fn_compute_blocks=1, Bn_compute_blocks=0``."""

    name = "fbcache"
    preset = {"Fn_compute_blocks": 1, "Bn_compute_blocks": 0}


class TaylorSeer(DBCache):
    """DBCache whose cached span residual is forecast by TaylorSeer (``taylorseer_order`` 1 or 2)."""

    name = "taylorseer"
    preset = {"enable_taylorseer": True}
