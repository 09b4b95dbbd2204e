"""fv-cache-dit on LTX-2: the block seam carries both streams; threshold 0 is the uncached output,
caching skips spans, and interleaved cached requests equal serial ones bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

import fv_cache_dit.plugin
import fv_core
import fv_ltx2.plugin
from fv_core.deploy.card import parse_deploy
from fv_core.parity import assert_interleave_parity
from fv_core.plugins import PluginHost
from fv_core.runtime import Engine

OPTS = {"Fn_compute_blocks": 1, "Bn_compute_blocks": 0, "max_warmup_steps": 1}


@pytest.fixture(scope="module")
def cached(ltx_path):
    host = PluginHost(env={})
    host.add(fv_ltx2.plugin, "fv-ltx2")
    host.add(fv_cache_dit.plugin, "fv-cache-dit")
    host.collect()
    deploy = parse_deploy(
        {
            "plugins": ["fv-ltx2", "fv-cache-dit"],
            "models": [{"card": "ltx2-tiny", "weights": ltx_path, "interceptors": ["dbcache"]}],
            "plugin_options": {"fv-cache-dit": OPTS},
        }
    )
    return fv_core.load("ltx2-tiny", deploy=deploy, host=host)


def test_threshold_zero_is_the_uncached_output(cached, ltx_host, ltx_path):
    plain = fv_core.load("ltx2-tiny", ltx_path, host=ltx_host).generate(prompt="a cat", num_inference_steps=6)
    zero = cached.generate(
        prompt="a cat",
        num_inference_steps=6,
        plugin_options={"fv-cache-dit": {"residual_diff_threshold": 0.0}},
    )
    assert np.array_equal(zero.frames, plain.frames) and np.array_equal(
        zero.audio.samples, plain.audio.samples
    )
    stats = zero.provenance["metrics"]["cache_dit"]
    assert stats["cached"] == 0 and set(stats["branches"]) == {"cfg", "modality"}  # STG's is the cond call


def test_caching_skips_spans_and_interleaves_exactly(cached):
    loose = {"fv-cache-dit": {"residual_diff_threshold": 5.0}}
    video = cached.generate(prompt="a cat", num_inference_steps=8, plugin_options=loose)
    assert video.provenance["metrics"]["cache_dit"]["cached"] > 0 and np.isfinite(video.frames).all()

    def items():
        asks = [
            dict(seed=1),
            dict(seed=2, prompt="rain", num_frames=17),
            dict(seed=3, stg_scale=0.0, audio_stg_scale=0.0),
        ]
        return [
            cached.job(
                cached.prepare(
                    {"prompt": "a cat", "num_inference_steps": 6, **a},
                    request_id=f"c{i}",
                    plugin_options=loose,
                )
            )
            for i, a in enumerate(asks)
        ]

    report = assert_interleave_parity(Engine, items)
    assert report.ok and report.max_abs == 0.0


def test_image_to_video_through_the_block_seam_is_exact(cached, ltx_host, ltx_path):
    """Per-token timesteps (the clean first frame) reach every block the same way through the seam."""
    from fv_core import ImagePart

    image = [ImagePart(np.random.default_rng(1).random((64, 64, 3)).astype(np.float32))]
    ask = dict(task="i2av", parts=image, prompt="a red ball", num_inference_steps=4, image_crf=0)
    plain = fv_core.load("ltx2-tiny", ltx_path, host=ltx_host).generate(**ask)
    zero = cached.generate(**ask, plugin_options={"fv-cache-dit": {"residual_diff_threshold": 0.0}})
    assert np.array_equal(zero.frames, plain.frames) and np.array_equal(
        zero.audio.samples, plain.audio.samples
    )
