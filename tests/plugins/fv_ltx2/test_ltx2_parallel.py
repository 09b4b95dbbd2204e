"""LTX-2 on parallel groups (gloo processes on CPU): sp=2, cfg=2 and sp=2 x cfg=2 equal one process within
the declared tolerance, video and audio, with FBCache on (same cache decisions); video and audio tokens
shard unevenly (down to an empty audio shard); per-token timesteps (i2av) shard with their tokens; the
two-stage program runs its base stage on the group; the interleave gate holds inside a group; batched calls split their rows over the cfg ranks; a request's
text crosses to the workers once; a wrong plan fails at load with its numbers.

The ``stg`` case runs a tiny LTX-2 with perturbed (STG) attention and per-head gates, so the STG and
modality branches change the output there, without FBCache so its calls batch. One group lives at a time
(a process holds one torch.distributed group): the module fixture is parametrized by case, so pytest
finishes every test of one group before it starts the next.
"""

from __future__ import annotations

import numpy as np
import pytest

import fv_cache_dit.plugin
import fv_core
import fv_ltx2.plugin
from fv_core import ConfigError, ImagePart
from fv_core.deploy.card import parse_deploy
from fv_core.parallel import TRAFFIC
from fv_core.parity import assert_interleave_parity
from fv_core.plugins import PluginHost
from fv_core.runtime import Engine
from fv_ltx2.t2av_loop import LTX2Loop
from fv_ltx2.tiny import write_tiny_checkpoint

# Declared fp32 tolerance of a parallel run against one process: a shard's (or a cfg rank's) matmuls
# have fewer rows, and CPU GEMM kernels round differently for small row counts. Measured worst cases on
# these requests: frames 1.4e-6 (two-stage, sp=2), audio 3e-8.
TOLERANCE = {"frames": 1e-5, "audio": 1e-5}
CASES = [("tiny", "sp=2"), ("tiny", "cfg=2"), ("tiny", "sp=2,cfg=2"), ("stg", "sp=2,cfg=2")]
CACHE = {"residual_diff_threshold": 0.3, "max_warmup_steps": 1}
IMAGE = ImagePart(np.random.default_rng(1).random((64, 64, 3)).astype(np.float32))
ASKS = {
    "t2av": dict(prompt="a cat", num_inference_steps=4, seed=1),  # 8 video tokens, 9 audio (5 + 4)
    # 9 video tokens (5 + 4) and 1 audio token: sequence rank 1 holds no audio at all
    "shards": dict(prompt="a cat", num_inference_steps=3, seed=2, num_frames=1, height=96, width=96),
    "i2av": dict(task="i2av", parts=(IMAGE,), prompt="a red ball", num_inference_steps=3, image_crf=0),
    # the base stage on the group; the upsampler and the LoRA-merged refine on rank 0. At 128x128 the base
    # stage's latents are 2x2 (at 64x64 they are 1x1, and the random upsampler's norms over them amplify a
    # shard's rounding, 1e-6, to 1.3e-5 in frames)
    "two-stage": dict(
        task="t2av-two-stage", prompt="a cat", num_inference_steps=3, seed=4, height=128, width=128
    ),
}


@pytest.fixture(scope="module")
def host() -> PluginHost:
    host = PluginHost(env={})
    host.add(fv_ltx2.plugin, "fv-ltx2")
    host.add(fv_cache_dit.plugin, "fv-cache-dit")
    return host.collect()


@pytest.fixture(scope="module")
def folders(ltx_path, tmp_path_factory) -> dict[str, str]:
    stg = tmp_path_factory.mktemp("ltx2") / "ltx2-stg"
    gates = {"perturbed_attn": True, "gated_attn": True, "audio_gated_attn": True}
    write_tiny_checkpoint(stg, transformer=gates, seed=5)
    return {"tiny": ltx_path, "stg": str(stg)}


def deploy(case: str, folder: str):
    """The tiny card on ``folder``; the tiny case with FBCache on (a threshold that skips calls here)."""
    entry = {"card": "ltx2-tiny", "weights": folder, "interceptors": ["fbcache"] if case == "tiny" else []}
    return parse_deploy(
        {"plugins": ["fv-ltx2", "fv-cache-dit"], "models": [entry], "plugin_options": {"fv-cache-dit": CACHE}}
    )


def run(model, ask: dict, **kw):
    ask = dict(ask)
    request = model.prepare(ask, task=ask.pop("task", None), parts=ask.pop("parts", ()), **kw)
    return Engine().run_one(*model.job(request))


@pytest.fixture(scope="module")
def single(host, folders) -> dict[str, dict]:
    """One-process results of every request the tests compare against, per case."""
    out = {}
    for case, folder in folders.items():
        model = fv_core.load(deploy=deploy(case, folder), host=host)
        out[case] = {name: run(model, ask) for name, ask in ASKS.items()}
    return out


@pytest.fixture(scope="module", params=CASES, ids=[f"{case}:{plan}" for case, plan in CASES])
def group(request, host, folders):
    case, plan = request.param
    model = fv_core.load(deploy=deploy(case, folders[case]), host=host, parallel=plan)
    yield case, model
    model.close()


def assert_close(reference, result) -> None:
    for name, tol in TOLERANCE.items():
        diff = np.abs(np.asarray(reference.outputs[name]) - np.asarray(result.outputs[name])).max()
        assert diff <= tol, f"{name}: max |single - parallel| = {diff:.3g} > {tol}"
    assert result.metrics.get("cache_dit") == reference.metrics.get("cache_dit"), "same cache decisions"


@pytest.mark.parametrize("ask", list(ASKS))
def test_matches_one_process(group, single, ask):
    case, model = group
    result = run(model, ASKS[ask])
    assert_close(single[case][ask], result)
    if ask == "two-stage":  # its metrics are the refine stage's: guidance off, no block seam
        return
    # without perturbed attention (the tiny case) STG's call is the cond call, and is not made
    assert result.metrics["branches"] == ["cfg", "stg", "modality"] if case == "stg" else ["cfg", "modality"]
    if case == "tiny":
        assert result.metrics["cache_dit"]["cached"] > 0, "FBCache skipped calls in the group too"


def test_interleave_gate_inside_group(group):
    _, model = group

    def items():
        return [model.job(model.prepare({**ASKS["t2av"], "seed": s}, request_id=f"g{s}")) for s in (1, 2)]

    assert_interleave_parity(Engine, items)


def test_batched_calls_split_rows_over_cfg_ranks(group, host, folders):
    """Three requests batched branch by branch (calls of up to 6 cfg rows, and stg / modality calls of
    two rows, split over the cfg ranks) equal each request run alone in one process. With FBCache on
    (the tiny cases) a group runs each request's calls alone, and they equal it all the same."""
    case, model = group
    asks = [dict(seed=1), dict(seed=2, prompt="rain"), dict(seed=3, stg_scale=0.0, audio_stg_scale=0.0)]
    asks = [{**ASKS["t2av"], **a} for a in asks]
    alone = fv_core.load(deploy=deploy(case, folders[case]), host=host)
    serial = [run(alone, a) for a in asks]
    batched = Engine().run_batched(
        [model.job(model.prepare(a, request_id=f"b{i}")) for i, a in enumerate(asks)]
    )
    for reference, result in zip(serial, batched, strict=True):
        assert_close(reference, result)


def test_plan_in_batch_key_and_provenance(group):
    _, model = group
    artifact = model.generate(**{**ASKS["t2av"], "num_inference_steps": 2})
    assert artifact.provenance["deploy"]["parallel"] == model.parallel.plan.id
    loop = LTX2Loop(model.instance)
    state = loop.init(model.prepare(ASKS["t2av"]))  # the prompt is cached: the first plan is a denoise call
    assert loop.next(state).batch_key.parallel_plan == model.parallel.plan.id


def test_text_crosses_to_workers_once(group):
    """A request's text embeddings (video and audio, [uncond, cond] and the cond row alone) reach each
    worker once, not at each of its 4 steps' branch calls (that would be at least 4x ``once``)."""
    _, model = group
    before = TRAFFIC.bytes.get("broadcast", 0)
    run(model, {**ASKS["t2av"], "prompt": "a prompt no other test used"})
    sent = TRAFFIC.bytes["broadcast"] - before
    row = 2 * 128 * 32 * 4  # a prompt row's video and audio text: 128 tokens x 32 floats each
    once = 3 * row * (model.parallel.plan.world_size - 1)  # the [uncond, cond] view and the cond row
    assert once <= sent < 2 * once


def test_wrong_plan_fails_at_load_with_the_numbers(host, ltx_path):
    with pytest.raises(ConfigError, match="sequence degree 4 does not divide the 2 attention heads"):
        fv_core.load("ltx2-tiny", ltx_path, host=host, parallel="sp=4")
    with pytest.raises(ConfigError, match="cfg degree 3 exceeds the card's maximum 2"):
        fv_core.load("ltx2-tiny", ltx_path, host=host, parallel="cfg=3")
