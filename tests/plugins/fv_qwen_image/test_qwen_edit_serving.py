"""The edit cards with what the text-to-image card has: packed batching (edits of different output sizes
share each step, each within the card's tolerance of itself alone), LoRA adapters per request (equal to the
same LoRA merged into the weights) and fv-cache-dit through the block seam (the interleave gate with
caching on; threshold 0 is the uncached image). One instance serves all, so the image is encoded once."""

from __future__ import annotations

import pytest
import torch
from conftest import picture
from safetensors.torch import save_file
from test_qwen_adapters import lora_pairs

import fv_cache_dit.plugin
import fv_core
from fv_cache_dit import FBCache
from fv_core.deploy.card import parse_deploy
from fv_core.parity import compare_results
from fv_core.plugins import PluginHost
from fv_core.request import image_part
from fv_core.runtime import Engine
from fv_core.runtime.policy import SchedulingPolicy
from fv_qwen_image import plugin
from tests.denoise_calls import DenoiseCalls

IMAGE = picture(60, 40, 1)
ASKS = [  # two output sizes, prompts of other lengths, true CFG off (one forward a step)
    dict(prompt="make it blue", height=32, width=48, seed=1),
    dict(prompt="add a small red hat on top", height=48, width=32, seed=2),
]


@pytest.fixture(scope="module")
def model(edit_path):
    host = PluginHost(env={})
    host.add(plugin, "fv-qwen-image")
    host.add(fv_cache_dit.plugin, "fv-cache-dit")
    deploy = parse_deploy(
        {
            "plugins": ["fv-qwen-image", "fv-cache-dit"],
            "models": [
                {
                    "card": "qwen-image-edit-tiny",
                    "weights": edit_path,
                    "kernels": {"packed_attention": "segments"},
                }
            ],
        }
    )
    return fv_core.load("qwen-image-edit-tiny", deploy=deploy, host=host.collect())


def items(model, asks, options=None):
    return [
        model.job(
            model.prepare(
                {**a, "num_inference_steps": 2},
                parts=[image_part(IMAGE)],
                request_id=f"e{i}",
                plugin_options=options[i] if options else None,
            )
        )
        for i, a in enumerate(asks)
    ]


@pytest.fixture(scope="module")
def alone(model):
    """Each edit run alone: the reference of every test here."""
    with torch.no_grad():
        return Engine().run_serial(items(model, ASKS))


def test_edits_of_two_sizes_pack_into_one_step_equal_alone(model, alone):
    calls = DenoiseCalls()
    with torch.no_grad():
        packed = Engine(observers=[calls], scheduling=SchedulingPolicy("fair")).run_batched(
            items(model, ASKS)
        )
    assert calls.sizes == [2] * 4  # each edit's two steps shared one call with the other
    report = compare_results(alone, packed, "batched", tolerance=model.card.parity.tolerances["frames"])
    assert report.ok, str(report)
    assert packed[1].outputs["frames"].shape[1:3] == (48, 32)


def test_an_edit_with_a_lora_equals_the_lora_merged_into_the_weights(model, alone, tmp_path):
    dit = model.instance.component("transformer")
    pairs = lora_pairs(dit, seed=3)
    save_file(pairs, tmp_path / "style.safetensors")
    model.instance.adapters.add("style", tmp_path / "style.safetensors")
    ask = {**ASKS[0], "num_inference_steps": 2}
    with torch.no_grad():
        got = model.generate(image=IMAGE, **ask, adapters=[("style", 0.6)]).image
        saved = {}
        for key, a in pairs.items():
            if key.endswith("lora_A.weight"):
                name = key.removeprefix("transformer.").removesuffix(".lora_A.weight")
                linear = dit.get_submodule(name)
                saved[name] = linear.weight.clone()
                linear.weight += 0.6 * pairs[key.replace("lora_A", "lora_B")] @ a
        try:
            merged = model.generate(image=IMAGE, **ask).image
        finally:
            for name, weight in saved.items():
                dit.get_submodule(name).weight.copy_(weight)
    assert abs(got - merged).max() <= model.card.parity.tolerances["frames"]
    assert abs(got - alone[0].outputs["frames"][0].numpy()).max() > 1e-3, "the adapter changes the image"


def test_fbcache_edits_interleaved_equal_serial_and_cache_by_threshold(model, alone):
    options = [{"fv-cache-dit": {"residual_diff_threshold": r}} for r in (0.0, 0.8)]
    with torch.no_grad():
        serial = Engine(interceptors=[FBCache(max_warmup_steps=1)]).run_serial(items(model, ASKS, options))
        interleaved = Engine(interceptors=[FBCache(max_warmup_steps=1)]).run_interleaved(
            items(model, ASKS, options)
        )
    report = compare_results(serial, interleaved, "interleave", tolerance=0.0)
    assert report.ok and report.max_abs == 0.0, str(report)
    stats = [r.metrics["cache_dit"] for r in serial]
    assert all(s["computed"] + s["cached"] == 2 for s in stats)
    assert stats[0]["cached"] == 0 and torch.equal(serial[0].outputs["frames"], alone[0].outputs["frames"])
    assert stats[1]["cached"] > 0
