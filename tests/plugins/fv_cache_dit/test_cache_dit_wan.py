"""fv-cache-dit on Wan through the block seam: the gate, exactness at threshold 0, FastWan rejects it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import fv_cache_dit.plugin
import fv_core
import fv_wan.plugin
from fv_cache_dit import DBCache, FBCache, TaylorSeer
from fv_core import ConfigError
from fv_core.deploy.card import parse_deploy
from fv_core.deploy.check import check_deploy
from fv_core.extend import BaseObserver
from fv_core.parity import compare_results
from fv_core.plugins import PluginHost
from fv_core.request import Request
from fv_core.runtime import Engine
from fv_wan.cards import fastwan_1_3b
from fv_wan.t2v_loop import WanLoop
from fv_wan.tiny import tiny_weights

PROMPTS = ["a cat running in the forest", "a red car in the city at night", "a boat on the lake"]
BASE = dict(
    negative_prompt="blurry low quality",
    num_frames=5,
    height=32,
    width=32,
    num_inference_steps=8,
    guidance_scale=5.0,
    max_sequence_length=512,
)
OPTS = dict(Fn_compute_blocks=1, Bn_compute_blocks=0, max_warmup_steps=2)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tiny_weights(tmp_path_factory.mktemp("wan") / "tiny")
    return fv_core.load("wan2.1-t2v-tiny", folder, host=wan_host())


def wan_request(model, rid: str, i: int, **options) -> Request:
    """A request whose fv-cache-dit options ``options`` pass the core's one validation (``prepare``)."""
    params = {**BASE, "prompt": PROMPTS[i % len(PROMPTS)], "seed": i}
    return model.prepare(
        params, request_id=rid, plugin_options={"fv-cache-dit": options} if options else None
    )


def test_interleaved_wan_requests_with_different_thresholds_equal_serial(model):
    asks = [
        dict(residual_diff_threshold=0.1),
        dict(residual_diff_threshold=0.3, enable_taylorseer=True),
        dict(residual_diff_threshold=0.6),
    ]

    def items():
        return [model.job(wan_request(model, f"w{i}", i, **ask)) for i, ask in enumerate(asks)]

    with torch.no_grad():
        serial = Engine(interceptors=[DBCache(**OPTS)]).run_serial(items())
        interleaved = Engine(interceptors=[DBCache(**OPTS)]).run_interleaved(items())
    report = compare_results(serial, interleaved, "interleave", tolerance=0.0)  # the gate's own check
    assert report.ok and report.max_abs == 0.0, str(report)
    stats = [r.metrics["cache_dit"] for r in interleaved if r is not None]
    assert stats == [r.metrics["cache_dit"] for r in serial if r is not None]
    assert set(stats[0]["branches"]) == {"cond", "uncond"}  # two-forward CFG: one cache per branch
    assert all(s["computed"] + s["cached"] == 2 * BASE["num_inference_steps"] for s in stats)
    assert stats[2]["cached"] > stats[0]["cached"]  # a higher threshold caches more


class DenoiseBatches(BaseObserver):
    """``batched_with`` of every denoise step."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def on_step(self, state, plan, result) -> None:
        if plan.label.startswith("denoise"):
            self.sizes.append(result.batched_with)


@pytest.mark.parametrize("cfg_mode", ["two_forward", "batched"])
def test_four_fbcache_requests_run_batched_and_equal_their_solo_runs(model, cfg_mode):
    thresholds = [0.05, 0.2, 0.4, 0.8]

    def items():
        return [
            model.job(
                model.prepare(
                    {**BASE, "prompt": PROMPTS[i % len(PROMPTS)], "seed": i, "cfg_mode": cfg_mode},
                    request_id=f"b{i}",
                    plugin_options={"fv-cache-dit": {"residual_diff_threshold": r}},
                )
            )
            for i, r in enumerate(thresholds)
        ]

    seen = DenoiseBatches()
    with torch.no_grad():
        solo = Engine(interceptors=[FBCache(max_warmup_steps=2)]).run_serial(items())
        batched = Engine(observers=[seen], interceptors=[FBCache(max_warmup_steps=2)]).run_batched(items())
    assert seen.sizes == [4] * 4 * BASE["num_inference_steps"]  # each request, each step: one call of four
    tol = model.card.parity.tolerances["frames_batched_cfg"]  # rows concatenated, as for uncached batches
    report = compare_results(solo, batched, "batched", tolerance=tol)
    assert report.ok, str(report)
    stats = [r.metrics["cache_dit"] for r in batched if r is not None]
    assert stats == [r.metrics["cache_dit"] for r in solo if r is not None]  # each its solo decisions
    cached = [s["cached"] for s in stats]
    assert cached[-1] > cached[0] and len(set(cached)) > 1  # ... which differ within each batch


@pytest.mark.parametrize("cfg_mode", ["two_forward", "batched"])
def test_threshold_zero_is_the_uncached_output(model, cfg_mode):
    params = {**BASE, "prompt": PROMPTS[0], "cfg_mode": cfg_mode}
    asked = {"fv-cache-dit": {"residual_diff_threshold": 0.0}}
    with torch.no_grad():
        plain = Engine().run_one(*model.job(model.prepare(params)))
        zero = Engine(interceptors=[TaylorSeer(**OPTS)]).run_one(
            *model.job(model.prepare(params, plugin_options=asked))
        )
    assert torch.equal(zero.outputs["frames"], plain.outputs["frames"])
    stats = zero.metrics["cache_dit"]
    assert (
        stats["cached"] == 0
        and stats["computed"] == (2 if cfg_mode == "two_forward" else 1) * BASE["num_inference_steps"]
    )


def wan_host() -> PluginHost:
    host = PluginHost(env={})
    host.add(fv_wan.plugin, "fv-wan")
    host.add(fv_cache_dit.plugin, "fv-cache-dit")
    return host.collect()


def test_fastwan_card_rejects_block_skipping(model):
    fastwan = SimpleNamespace(card=fastwan_1_3b())
    with pytest.raises(ConfigError, match=r"card 'fastwan2.1-t2v-1.3b' rejects interceptor 'fbcache'.*dmd2"):
        Engine(interceptors=[FBCache()]).run_one(WanLoop(model.instance), wan_request(model, "f", 0), fastwan)
    host = wan_host()
    deploy = {"plugins": ["fv-wan", "fv-cache-dit"], "models": [{"card": "wan2.1-t2v-tiny"}]}
    deploy["models"][0]["interceptors"] = ["dbcache"]
    assert check_deploy(parse_deploy(deploy), host) == []
    deploy["models"][0]["card"] = "fastwan2.1-t2v-1.3b"
    [problem] = check_deploy(parse_deploy(deploy), host)
    assert (
        "rejects 'dbcache' (a block_skip interceptor: it skips transformer blocks of a denoise step)"
        in problem
    )
