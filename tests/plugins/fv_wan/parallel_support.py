"""Shared pieces of the parallel-group tests: plugins, the deploy with FBCache on, requests, the tolerance."""

from __future__ import annotations

from fv_core.deploy.card import DeploymentCard, parse_deploy
from fv_core.loop.contracts import LoopResult
from fv_core.plugins import PluginHost
from fv_core.runtime import Engine

# Declared fp32 tolerance of a parallel run against one process: a sequence shard's matmuls have fewer
# rows, and CPU GEMM kernels round differently for small row counts (by an ulp). Measured worst cases
# are in the README's parallelism section.
TOLERANCE = {"latents": 1e-5, "frames": 5e-5}
PLANS = ["sp=2", "cfg=2", "sp=2,cfg=2"]
CACHE = {"residual_diff_threshold": 0.2, "max_warmup_steps": 2}
TINY = dict(
    prompt="a red circle", negative_prompt="blurry", num_inference_steps=5, guidance_scale=5.0, seed=3
)
SHAPES = dict(prompt="a green square moving left", num_inference_steps=6, seed=1)


def plugin_host() -> PluginHost:
    from fv_cache_dit import plugin as cache_dit
    from fv_sta import plugin as sta
    from fv_wan import plugin as wan

    host = PluginHost(env={})
    host.add(wan, "fv-wan")
    host.add(cache_dit, "fv-cache-dit")
    host.add(sta, "fv-sta")
    return host.collect()


def deploy(card: str) -> DeploymentCard:
    """``card`` with FBCache on (a threshold that skips blocks at these sizes)."""
    return parse_deploy(
        {
            "plugins": ["fv-wan", "fv-cache-dit"],
            "models": [{"card": card, "interceptors": ["fbcache"]}],
            "plugin_options": {"fv-cache-dit": CACHE},
        }
    )


def run(model, params: dict) -> LoopResult:
    return Engine().run_one(*model.job(model.prepare(params)))


def assert_close(reference: LoopResult, result: LoopResult) -> None:
    for name, tol in TOLERANCE.items():
        diff = (reference.outputs[name] - result.outputs[name]).abs().max().item()
        assert diff <= tol, f"{name}: max |single - parallel| = {diff:.3g} > {tol}"
    assert result.metrics.get("cache_dit") == reference.metrics.get("cache_dit"), "same cache decisions"
