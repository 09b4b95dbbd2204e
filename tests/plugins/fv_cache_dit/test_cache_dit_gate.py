"""Caching under the interleave gate: per-request state passes it, a module-global cache fails it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from cache_dit_support import BlockDenoiseLoop, request

from fv_cache_dit import DBCache, FBCache, TaylorSeer
from fv_core import ConfigError
from fv_core.extend import BaseObserver
from fv_core.parity import assert_interleave_parity, check_batched_parity
from fv_core.runtime import Engine

LOOP = BlockDenoiseLoop()
OPTS = dict(Fn_compute_blocks=1, Bn_compute_blocks=1, max_warmup_steps=2)


def items() -> list[tuple[Any, Any, Any]]:
    """Different seeds (prompts), thresholds and variants per request."""
    asks = [
        dict(residual_diff_threshold=0.1),
        dict(residual_diff_threshold=0.3, enable_taylorseer=True),
        dict(residual_diff_threshold=0.2, Fn_compute_blocks=2, Bn_compute_blocks=0),
        dict(residual_diff_threshold=0.5, max_continuous_cached_steps=2, taylorseer_order=2),
    ]
    return [(LOOP, request(f"r{i}", seed=i, **ask), None) for i, ask in enumerate(asks)]


class Finished(BaseObserver):
    """Collects each finished request's cache statistics, run after run."""

    def __init__(self) -> None:
        self.stats: list[tuple[str, dict]] = []

    def on_finish(self, state, result) -> None:
        self.stats.append((state.request_id, result.metrics["cache_dit"]))


def test_interleaved_equals_serial_bit_for_bit_with_caching_on():
    finished = Finished()
    report = assert_interleave_parity(
        lambda: Engine(observers=[finished], interceptors=[DBCache(**OPTS)]), items
    )
    assert report.max_abs == 0.0
    serial, interleaved = dict(finished.stats[:4]), dict(finished.stats[4:])
    assert serial == interleaved  # the same decisions, step by step, branch by branch
    cached = [s["cached"] for s in serial.values()]
    assert all(c > 0 for c in cached) and len(set(cached)) > 1  # every request caches, each its own way
    assert all(s["computed"] + s["cached"] == 2 * 12 for s in serial.values())  # 2 CFG branches x 12 steps


BATCHED_TOL = 1e-5  # rows concatenated: the tiny DiT's matmuls see 4 rows instead of 1


class Batched(BaseObserver):
    """Each step's ``batched_with`` and each finished request's cache statistics."""

    def __init__(self) -> None:
        self.batched_with: list[int] = []
        self.stats: list[tuple[str, dict]] = []

    def on_step(self, state, plan, result) -> None:
        self.batched_with.append(result.batched_with)

    def on_finish(self, state, result) -> None:
        self.stats.append((state.request_id, result.metrics["cache_dit"]))


def test_cached_requests_stay_batched_and_equal_their_serial_runs():
    seen = Batched()
    report = check_batched_parity(
        lambda: Engine(observers=[seen], interceptors=[TaylorSeer(**OPTS)]), items, tol=BATCHED_TOL
    )
    serial, batched = seen.batched_with[:48], seen.batched_with[48:]
    assert set(serial) == {1} and batched == [4] * 48  # 12 steps of 4 requests, each step one call of 4
    assert dict(seen.stats[:4]) == dict(seen.stats[4:])  # every request made its serial decisions
    assert 0.0 < report.max_abs <= BATCHED_TOL


_SHARED: dict[str, dict[str, Any]] = {}  # THE BUG: one cache per transformer, as the cache-dit package keeps


class ModuleGlobalDBCache(DBCache):
    """DBCache whose branch caches live in a module global instead of the request's plugin_state."""

    def run_blocks(self, caches, branch, hidden, num_blocks, block):
        view = {"options": caches["options"], branch: _SHARED.get(branch, {})}
        out = super().run_blocks(view, branch, hidden, num_blocks, block)
        _SHARED[branch] = view[branch]
        return out


def test_the_gate_catches_a_module_global_cache():
    _SHARED.clear()
    with pytest.raises(AssertionError, match="interleave parity: max_abs="):
        assert_interleave_parity(lambda: Engine(interceptors=[ModuleGlobalDBCache(**OPTS)]), items)


def test_threshold_zero_reproduces_the_uncached_output_exactly():
    plain = Engine().run_one(LOOP, request("p", seed=3), None)
    for icp in (FBCache(), DBCache(**OPTS), TaylorSeer(**OPTS)):
        zero = Engine(interceptors=[icp]).run_one(
            LOOP, request("z", seed=3, residual_diff_threshold=0.0), None
        )
        assert torch.equal(zero.outputs["latents"], plain.outputs["latents"])
        assert zero.metrics["cache_dit"]["cached"] == 0
    cached = Engine(interceptors=[FBCache()]).run_one(
        LOOP, request("c", seed=3, residual_diff_threshold=0.3), None
    )
    assert cached.metrics["cache_dit"]["cached"] > 0
    assert not torch.equal(cached.outputs["latents"], plain.outputs["latents"])


class _StepSkip:
    plugin_id, kind = "skip", "step_skip"

    def __init__(self, name: str) -> None:
        self.name = name


def test_at_most_one_interceptor_per_kind():
    with pytest.raises(ConfigError, match=r"\['fbcache', 'dbcache'\] are all 'block_skip'"):
        Engine(interceptors=[FBCache(), DBCache()])
    with pytest.raises(ConfigError, match="at most one step_skip interceptor"):
        Engine(interceptors=[_StepSkip("a"), _StepSkip("b")])
