"""DBCache / FBCache / TaylorSeer decisions on a hand-checked case, and the options trust boundary."""

from __future__ import annotations

import pytest
import torch

import fv_cache_dit.plugin
from fv_cache_dit import CacheDiTOptions, DBCache, FBCache, TaylorSeer
from fv_core import ConfigError, DeploymentCard
from fv_core.deploy.check import validate_plugin_options
from fv_core.loop import LoopState
from fv_core.plugins import PluginHost
from fv_core.request import Request

# Four additive blocks: block i adds BLOCKS[step][i]. With Fn=1, Bn=1 the front residual at step s is
# FRONT[s] and the middle span (blocks 1, 2) adds MIDDLE[s].
FRONT = [1.0, 1.1, 1.5, 1.6, 1.7, 1.75, 1.8, 1.85]
MIDDLE = [0.5, 0.9, 0.7, 0.1, 0.2, 1.3, 0.3, 0.4]
COMPUTE, CACHED = [0, 1, 2, 3], [0, 3]  # blocks run on a computed / a cached step
BACK = 0.01


def drive(icp: DBCache, steps: int = 8) -> tuple[list[list[int]], list[torch.Tensor], dict]:
    """Run the four blocks through ``icp`` for ``steps`` calls; returns blocks run per call, outputs, state."""
    caches: dict = {"options": icp.options.model_dump()}
    calls: list[list[int]] = []
    outs = []
    for s in range(steps):
        calls.append([])
        adds = [FRONT[s], MIDDLE[s], 0.0, BACK]

        def block(i: int, h: torch.Tensor, s: int = s, adds: list[float] = adds) -> torch.Tensor:
            calls[s].append(i)
            return h + adds[i]

        outs.append(icp.run_blocks(caches, "main", torch.zeros(2, 3), 4, block))
    return calls, outs, caches["main"]


HAND_CHECKED = dict(
    Fn_compute_blocks=1,
    Bn_compute_blocks=1,
    residual_diff_threshold=0.2,
    max_warmup_steps=1,
    max_continuous_cached_steps=2,
)


def test_dbcache_decisions_match_the_hand_checked_algorithm():
    calls, outs, cache = drive(DBCache(**HAND_CHECKED))
    # 0: warmup, compute (reference 1.0). 1: |1.0-1.1|/1.0 = 0.1 < 0.2, cache. 2: a cached step keeps the
    # reference: |1.0-1.5|/1.0 = 0.5, compute (reference 1.5). 3: 0.1/1.5 = 0.067, cache. 4: 0.2/1.5 =
    # 0.133, cache. 5: two cached steps in a row, compute without comparing (reference 1.75).
    # 6: 0.05/1.75 = 0.029, cache. 7: 0.1/1.75 = 0.057, cache.
    assert cache["cached_steps"] == [1, 3, 4, 6, 7]
    assert calls == [COMPUTE, CACHED, COMPUTE, CACHED, CACHED, COMPUTE, CACHED, CACHED]
    diffs = {"1": 0.1, "2": 0.5, "3": 0.1 / 1.5, "4": 0.2 / 1.5, "6": 0.05 / 1.75, "7": 0.1 / 1.75}
    assert cache["residual_diffs"] == pytest.approx(diffs, rel=1e-5)
    # a cached step adds the middle span's residual of the last computed step
    for s, last in ((1, 0), (3, 2), (4, 2), (6, 5), (7, 5)):
        assert torch.allclose(outs[s], torch.full((2, 3), FRONT[s] + MIDDLE[last] + BACK))


def test_limits_and_warmup_interval():
    _, _, cache = drive(DBCache(Fn_compute_blocks=1, residual_diff_threshold=0.9, max_warmup_steps=1))
    assert cache["cached_steps"] == [1, 2, 3, 4, 5, 6, 7]  # Bn=0: the last block belongs to the cached span
    _, _, cache = drive(FBCache(residual_diff_threshold=0.9, max_warmup_steps=1, max_cached_steps=2))
    assert cache["cached_steps"] == [1, 2]
    _, _, cache = drive(FBCache(residual_diff_threshold=0.9, max_warmup_steps=4, warmup_interval=2))
    assert cache["cached_steps"] == [1, 3, 4, 5, 6, 7]  # warmup steps are range(0, 4, 2) = 0, 2
    _, _, cache = drive(FBCache(residual_diff_threshold=0.0, max_warmup_steps=0))
    assert cache.get("cached_steps", []) == []  # threshold 0 never caches


@pytest.mark.parametrize("order", [1, 2])
def test_taylorseer_forecasts_the_cached_span(order):
    _, outs, cache = drive(TaylorSeer(**HAND_CHECKED, taylorseer_order=order))
    assert cache["cached_steps"] == [1, 3, 4, 6, 7]  # the same decisions as DBCache
    m0, m2, m5 = MIDDLE[0], MIDDLE[2], MIDDLE[5]
    d1_2 = (m2 - m0) / 2  # computed steps 0, 2, 5: first derivative at 2 over a 2-step window
    d1_5 = (m5 - m2) / 3
    d2_5 = (d1_5 - d1_2) / 3 if order == 2 else 0.0
    expected = {1: m0, 3: m2 + d1_2, 4: m2 + 2 * d1_2, 6: m5 + d1_5 + d2_5 / 2, 7: m5 + 2 * d1_5 + 2 * d2_5}
    for s, span in expected.items():
        assert torch.allclose(outs[s], torch.full((2, 3), FRONT[s] + span + BACK)), s


def test_too_many_compute_blocks_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"Fn_compute_blocks=3 \+ Bn_compute_blocks=2 exceed the model's 4"):
        drive(DBCache(Fn_compute_blocks=3, Bn_compute_blocks=2))


def test_the_requests_options_override_the_interceptors_own():
    icp = FBCache(residual_diff_threshold=0.3)  # this interceptor's defaults
    state = LoopState("r", "t2v")
    icp.on_start(state, Request("r", options={"fv-cache-dit": CacheDiTOptions(max_warmup_steps=2)}))
    opts = state.plugin_state["fv-cache-dit"]["options"]
    assert (opts["residual_diff_threshold"], opts["max_warmup_steps"], opts["Fn_compute_blocks"]) == (
        0.3,
        2,
        1,
    )
    with pytest.raises(ConfigError, match="interceptor 'fbcache': residual_diff_threshold.*got -1"):
        FBCache(residual_diff_threshold=-1)


def test_plugin_registers_interceptor_kinds_and_the_options_schema():
    host = PluginHost(env={})
    host.add(fv_cache_dit.plugin, "fv-cache-dit")
    host = host.collect()
    names = {n: host.registries.interceptors.get(n).kind for n in host.registries.interceptors}
    assert names == {"fbcache": "block_skip", "dbcache": "block_skip", "taylorseer": "block_skip"}
    assert host.registries.options.get("fv-cache-dit") is CacheDiTOptions
    deploy = DeploymentCard(plugins=["fv-cache-dit"], models=[{"card": "c"}])
    assert (
        validate_plugin_options(host, deploy, "fv-cache-dit", {"taylorseer_order": 2}).taylorseer_order == 2
    )
    with pytest.raises(ConfigError, match="taylorseer_order"):
        validate_plugin_options(host, deploy, "fv-cache-dit", {"taylorseer_order": 3})
