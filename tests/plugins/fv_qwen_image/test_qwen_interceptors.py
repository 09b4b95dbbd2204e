"""fv-cache-dit on Qwen-Image through the block seam (the interleave gate with caching on, threshold 0
is the uncached image, a higher threshold caches more), and weight sync scoping the text cache."""

from __future__ import annotations

import pytest
import torch

import fv_cache_dit.plugin
import fv_core
from fv_cache_dit import FBCache
from fv_core.parity import compare_results
from fv_core.plugins import PluginHost
from fv_core.runtime import Engine
from fv_qwen_image import plugin

BASE = dict(negative_prompt=" ", true_cfg_scale=4.0, height=32, width=32, num_inference_steps=3)
PROMPTS = ["a cat holding a sign", "a lighthouse", "a bowl of soup"]


@pytest.fixture(scope="module")
def model(tiny_path):
    host = PluginHost(env={})
    host.add(plugin, "fv-qwen-image")
    host.add(fv_cache_dit.plugin, "fv-cache-dit")
    return fv_core.load("qwen-image-tiny", tiny_path, host=host.collect())


def items(model, thresholds):
    return [
        model.job(
            model.prepare(
                {**BASE, "prompt": PROMPTS[i], "seed": i},
                request_id=f"c{i}",
                plugin_options={"fv-cache-dit": {"residual_diff_threshold": r}},
            )
        )
        for i, r in enumerate(thresholds)
    ]


def test_fbcache_requests_interleaved_equal_serial_and_cache_by_threshold(model):
    thresholds = [0.0, 0.8]
    with torch.no_grad():
        serial = Engine(interceptors=[FBCache(max_warmup_steps=1)]).run_serial(items(model, thresholds))
        interleaved = Engine(interceptors=[FBCache(max_warmup_steps=1)]).run_interleaved(
            items(model, thresholds)
        )
        plain = Engine().run_one(*model.job(model.prepare({**BASE, "prompt": PROMPTS[0], "seed": 0})))
    report = compare_results(serial, interleaved, "interleave", tolerance=0.0)
    assert report.ok and report.max_abs == 0.0, str(report)
    stats = [r.metrics["cache_dit"] for r in serial]
    assert set(stats[0]["branches"]) == {"cond", "uncond"}  # one cache per true-CFG branch
    assert all(s["computed"] + s["cached"] == 2 * BASE["num_inference_steps"] for s in stats)
    assert stats[0]["cached"] == 0 and torch.equal(serial[0].outputs["frames"], plain.outputs["frames"])
    assert stats[1]["cached"] > stats[0]["cached"]
    assert not torch.equal(serial[1].outputs["frames"], plain.outputs["frames"])


def test_a_text_encoder_sync_drops_only_its_features(tiny_model):
    inst = tiny_model.instance
    ask = dict(prompt="a sync test", height=32, width=32, num_inference_steps=2)
    tiny_model.generate(**ask)
    assert tiny_model.generate(**ask).provenance["metrics"]["text_cache_hits"] == 1
    old = inst.weights_versions["text_encoder"]
    try:
        assert inst.set_weights_version("text_encoder", "te-2") >= 1
        assert tiny_model.generate(**ask).provenance["metrics"]["text_cache_hits"] == 0
    finally:
        inst.set_weights_version("text_encoder", old)
