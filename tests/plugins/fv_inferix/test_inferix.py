"""fv-inferix on causal Wan (wan2.1-t2v-tiny-causal): local + retrieved global blocks under a budget.

Keeping everything equals full-history attention; under a budget the cache never holds more than the
request's window and sinks stay; retrieval changes what a block attends to and bounds it; requests
with different options interleave bit for bit (and batch within the card's tolerance); the plugin is
enabled by name in a deploy file, validated like the other interceptors, refused by cards without a
causal loop, and its profile reaches ``/metrics``."""

from __future__ import annotations

import pytest
import torch

import fv_core
import fv_inferix.plugin
import fv_wan.plugin
from fv_core import ConfigError
from fv_core.deploy.card import parse_deploy
from fv_core.deploy.check import check_deploy
from fv_core.extend import BaseObserver
from fv_core.plugins import PluginHost
from fv_core.runtime import Engine
from fv_core.training.rollout import rollout
from fv_inferix import Inferix
from fv_wan.tiny import tiny_weights

CAUSAL = "wan2.1-t2v-tiny-causal"


@pytest.fixture(scope="module")
def host() -> PluginHost:
    host = PluginHost(env={})
    host.add(fv_wan.plugin, "fv-wan")
    host.add(fv_inferix.plugin, "fv-inferix")
    return host.collect()


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> str:
    return tiny_weights(tmp_path_factory.mktemp("wan") / "wan2.1-t2v-tiny")


@pytest.fixture(scope="module")
def model(host, weights):
    torch.set_num_threads(1)
    return fv_core.load(CAUSAL, weights, host=host)


def request(model, rid="r", options=None, **params):
    ask = {"prompt": "a red circle moving left", "seed": 5, "num_frames": 37, "chunk_frames": 1, **params}
    return model.prepare(ask, request_id=rid, plugin_options={"fv-inferix": options} if options else None)


def run(model, req, *interceptors, observers=()):
    with torch.inference_mode():
        return Engine(interceptors=interceptors, observers=observers).run_one(*model.job(req))


class PoolWatch(BaseObserver):
    """The pool's used pages after every step."""

    def __init__(self, pool) -> None:
        self.pool, self.used = pool, []

    def on_step(self, state, plan, result) -> None:
        self.used.append(self.pool.used_pages)


def test_keeping_everything_equals_full_history(model):
    """A window that holds the whole video and a retrieval count that takes every block: fv-inferix
    attends to exactly what full-history attention does."""
    for params in (
        dict(window_frames=10, sink_frames=1),
        dict(num_frames=29, chunk_frames=2, window_frames=8),
    ):
        full = run(model, request(model, **params))
        kept = run(model, request(model, **params), Inferix(local_blocks=1, global_blocks=64))
        diff = (full.outputs["latents"] - kept.outputs["latents"]).abs().max().item()
        assert diff <= 1e-5, f"fv-inferix keeping everything vs full history: max |diff| {diff:.3g}"
        assert not kept.metrics["evicted_frames"] and kept.metrics["kv_policy"]["retrievals"] > 0


def test_under_a_budget_the_cache_never_holds_more_and_keeps_its_sinks(model):
    pool = model.instance.kv_pool
    tpf = 4  # tokens per latent frame of the tiny card's default 32 x 32 video
    budget = 4 * tpf * pool.page_bytes // pool.page_size  # window_frames=4
    watch = PoolWatch(pool)
    result = run(
        model,
        request(model, window_frames=4, sink_frames=1),
        Inferix(local_blocks=1, global_blocks=1),
        observers=[watch],
    )
    profile = result.metrics["kv_policy"]
    assert max(watch.used) * pool.page_bytes <= budget  # the pool's own count of pages held
    assert max(profile["cache_bytes"]) <= budget and profile["peak_cache_bytes"] == budget
    assert profile["evicted_blocks"] and 0 not in profile["evicted_blocks"]  # the sink stays
    assert result.metrics["max_cached_frames"] == 4 and pool.used_pages == 0  # pages come back
    # attended: sink + local + 1 retrieved block (3 frames) once the cache is full, not all 4 cached
    assert profile["attended_tokens"][-1] == 3 * tpf and profile["blocks"] == 10


def test_retrieval_decides_what_a_block_attends_to(model):
    """Fewer retrieved blocks change the video and bound the context; the eviction choice differs from
    the rolling window's (least relevant, not oldest)."""
    params = dict(window_frames=10, sink_frames=1)
    everything = run(model, request(model, **params), Inferix(global_blocks=64))
    one = run(model, request(model, **params), Inferix(global_blocks=1))
    assert (everything.outputs["latents"] - one.outputs["latents"]).abs().max() > 1e-3
    assert max(one.metrics["kv_policy"]["attended_tokens"]) == 3 * 4  # sink, local, one retrieved
    rolling = run(model, request(model, window_frames=4, sink_frames=1))
    relevance = run(model, request(model, window_frames=4, sink_frames=1), Inferix(global_blocks=64))
    assert rolling.metrics["evicted_frames"] != relevance.metrics["evicted_frames"]


MIXED = [
    dict(local_blocks=1, global_blocks=1),
    dict(local_blocks=2, global_blocks=0),
    dict(enabled=False),  # this request keeps the rolling window
]


def test_requests_with_different_options_interleave_bitwise_and_batch(model):
    def jobs():
        return [
            model.job(request(model, f"m{i}", opts, seed=i, window_frames=4, sink_frames=1))
            for i, opts in enumerate(MIXED)
        ]

    policy = Inferix()
    with torch.inference_mode():
        serial = Engine(interceptors=[policy]).run_serial(jobs())
        interleaved = Engine(interceptors=[policy]).run_interleaved(jobs())
        batched_with = []

        class Rows(BaseObserver):
            def on_step(self, state, plan, result) -> None:
                batched_with.append(result.batched_with)

        batched = Engine(interceptors=[policy], observers=[Rows()]).run_batched(jobs())
    for s, i, b in zip(serial, interleaved, batched, strict=True):
        assert torch.equal(s.outputs["latents"], i.outputs["latents"])
        assert (s.outputs["latents"] - b.outputs["latents"]).abs().max() <= 2e-4
        assert s.metrics["evicted_frames"] == b.metrics["evicted_frames"]
    assert max(batched_with) == 3  # chunk passes of all three ran as one call
    assert "kv_policy" in serial[0].metrics and serial[2].metrics["kv_policy"]["evicted_blocks"] == []
    assert serial[2].metrics["evicted_frames"] == list(range(1, 6))  # rolling: the oldest after the sink


def test_options_are_validated_with_the_value_the_rule_and_the_fix(model):
    with pytest.raises(ConfigError, match="local_blocks"):
        request(model, options={"local_blocks": 0})
    with pytest.raises(ConfigError, match="window_frames=2 .*Fix: raise window_frames to >= 3"):
        Inferix(local_blocks=2).check_request(request(model, window_frames=2, sink_frames=1), model.instance)
    with pytest.raises(ConfigError, match="global_blocks"):
        Inferix(global_blocks=-1)


def test_enabled_by_name_in_a_deploy_file_and_refused_by_cards_without_a_causal_loop(host, weights, tmp_path):
    entry = {"card": CAUSAL, "weights": weights, "interceptors": ["inferix"]}
    plan = {"plugins": ["fv-wan", "fv-inferix"], "models": [entry], "data_dir": str(tmp_path)}
    plan["plugin_options"] = {"fv-inferix": {"global_blocks": 2}}
    deploy = parse_deploy(plan)
    assert check_deploy(deploy, host) == []
    loaded = fv_core.load(CAUSAL, deploy=deploy, host=host)
    video = loaded.generate(prompt="a cat", num_frames=13, seed=1)
    assert video.provenance["metrics"]["kv_policy"]["options"]["global_blocks"] == 2
    [rolled] = rollout(
        loaded, [dict(prompt="a cat", num_frames=13, seed=1)]
    )  # the policy chose each context:
    assert not any(
        s.replayable for s in rolled.record.steps if s.label.startswith("chunk")
    )  # inputs alone differ
    bidirectional = parse_deploy({**plan, "models": [{**entry, "card": "wan2.1-t2v-tiny"}]})
    (problem,) = check_deploy(bidirectional, host)
    assert "rejects 'inferix' (a kv_policy interceptor: it decides the KV cache of a block-causal" in problem
    dense = fv_core.load("wan2.1-t2v-tiny", weights, host=host)
    with pytest.raises(ConfigError, match="block-causal"):
        run(dense, dense.prepare({"prompt": "a cat", "num_frames": 5}), Inferix())


def test_the_profile_reaches_metrics(host, weights, tmp_path):
    import httpx

    from tests.serving.support import ServerThread, wait_idle

    deploy = parse_deploy(
        {
            "plugins": ["fv-wan", "fv-inferix"],
            "models": [{"card": CAUSAL, "weights": weights, "interceptors": ["inferix"]}],
            "data_dir": str(tmp_path),
        }
    )
    with ServerThread(deploy, host) as server, httpx.Client(base_url=server.url, timeout=120) as http:
        body = {"prompt": "a cat", "num_frames": 21, "window_frames": 3, "sink_frames": 1}
        job = http.post("/v1/videos", json={**body, "plugin_options": {"fv-inferix": {"global_blocks": 1}}})
        assert job.status_code == 200, job.text
        bad = http.post("/v1/videos", json={**body, "plugin_options": {"fv-inferix": {"local_blocks": 5}}})
        assert bad.status_code == 400 and "window_frames" in bad.json()["error"]["message"]
        wait_idle(server)
        text = http.get("/metrics").text
    line = next(x for x in text.splitlines() if x.startswith("fv_kv_evictions_total"))
    assert 'policy="inferix"' in line and float(line.split()[-1]) > 0
    assert 'fv_kv_block_seconds_count{model="' + CAUSAL + '",policy="inferix"} 6.0' in text


def test_the_drift_bench_runs_end_to_end(tmp_path):
    """``bench/inferix_drift.py --smoke``: every policy rolls out, the bounded ones within the budget."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "drift.json"
    bench = Path(__file__).resolve().parents[3] / "bench" / "inferix_drift.py"
    subprocess.run(
        [sys.executable, str(bench), "--smoke", "--out", str(out)], check=True, capture_output=True
    )
    report = json.loads(out.read_text())
    assert set(report["policies"]) == {"full", "rolling", "inferix", "inferix-all-stored"}
    assert report["verdict"]["budget_held"] and report["verdict"]["budget_vs_full_history"] < 0.5
    assert out.with_suffix(".png").stat().st_size > 10_000
