"""FBCache on LTX-2 with step batching: every call of a step runs once for all cached requests, each
request's rows equal its solo cached run within the batched tolerance, with its solo decisions."""

from __future__ import annotations

import pytest
import torch

import fv_core
from fv_cache_dit import FBCache
from fv_core.extend import BaseObserver
from fv_core.parity import compare_results
from fv_core.plugins import PluginHost
from fv_core.runtime import Engine
from fv_ltx2 import plugin
from fv_ltx2.tiny import tiny_weights

CACHE = dict(residual_diff_threshold=0.3, max_warmup_steps=1)
BATCHED_TOL = 1e-5  # the tolerance of LTX-2's uncached batched calls (tests/plugins/fv_ltx2)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    host = PluginHost(env={})
    host.add(plugin, "fv-ltx2")
    return fv_core.load(
        "ltx2-tiny", tiny_weights(tmp_path_factory.mktemp("ltx2") / "tiny"), host=host.collect()
    )


class Calls(BaseObserver):
    def __init__(self) -> None:
        self.sizes: list[int] = []

    def on_step(self, state, plan, result) -> None:
        if plan.label.startswith("denoise"):
            self.sizes.append(result.batched_with)


def test_three_fbcache_requests_batch_branch_by_branch(model):
    def items():
        asks = [dict(seed=1), dict(seed=2, prompt="rain on a roof"), dict(seed=3)]
        return [
            model.job(model.prepare({"prompt": "a cat", "num_inference_steps": 4, **a}, request_id=f"c{i}"))
            for i, a in enumerate(asks)
        ]

    calls = Calls()
    with torch.no_grad():
        solo = Engine(interceptors=[FBCache(**CACHE)]).run_serial(items())
        batched = Engine(observers=[calls], interceptors=[FBCache(**CACHE)]).run_batched(items())
    assert calls.sizes and set(calls.sizes) == {3}  # every branch call of every step: one call of three
    report = compare_results(solo, batched, "batched", tolerance=BATCHED_TOL)
    assert report.ok, str(report)
    stats = [r.metrics["cache_dit"] for r in batched if r is not None]
    assert stats == [r.metrics["cache_dit"] for r in solo if r is not None]
    assert all(s["cached"] > 0 for s in stats)
