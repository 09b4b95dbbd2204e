"""Cards, plugin registration, FastWan recipe teeth, request validation."""

from __future__ import annotations

import pytest
from wan_support import front, run, tiny_instance

from fv_core import ConfigError, RecipeLoopMismatch, UnknownKeyError
from fv_core.plugins import PluginHost
from fv_wan import plugin
from fv_wan.cards import CARDS, fastwan_1_3b, wan_tiny
from fv_wan.shortcuts import card


def test_plugin_registers_every_card():
    host = PluginHost(env={})
    host.add(plugin, "fv-wan")
    host.collect()
    assert not host.errors
    for factory in CARDS:
        model_id = factory().model_id
        assert host.card(model_id).model_id == model_id
    assert host.card("wan2.1-t2v-tiny").default_weights == "fv_wan.tiny:tiny_weights"


def test_tiny_card_says_its_weights_are_random():
    assert "RANDOM weights" in wan_tiny().description


def test_unknown_model_lists_available():
    with pytest.raises(UnknownKeyError, match="wan2.1-t2v-tiny"):
        card("wan9-nope")


def test_fastwan_refuses_a_50_step_sampler(tiny_path):
    fast = front(tiny_instance(tiny_path, fastwan_1_3b()))
    with pytest.raises(RecipeLoopMismatch, match="3 steps"):
        fast.prepare({"prompt": "a cat", "num_inference_steps": 50})
    with pytest.raises(RecipeLoopMismatch, match="dmd"):
        fast.prepare({"prompt": "a cat", "sampler": "unipc"})


def test_fastwan_three_step_loop_runs(tiny_path):
    fast = tiny_instance(tiny_path, fastwan_1_3b())
    result = run(fast, seed=1, guidance_scale=1.0, sampler="dmd", height=32, width=32)
    assert result.metrics["steps"] == 3 and tuple(result.outputs["frames"].shape) == (5, 32, 32, 3)


@pytest.mark.parametrize(
    "params,match",
    [
        ({"num_frames": 6}, "4k\\+1"),
        ({"num_frames": 0}, "num_frames.*greater than or equal to 1"),
        ({"height": 40}, "multiple of 16"),
        ({"width": 8}, "width.*greater than or equal to 16"),
        ({"num_inference_steps": 0}, "num_inference_steps"),
        ({"num_inference_steps": 500}, "1..200"),
        ({"guidance_scale": 99.0}, "guidance_scale"),
        ({"guidance_scale": -1.0}, "guidance_scale"),
        ({"cfg_mode": "triple"}, "cfg_mode"),
        ({"sampler": "ddim"}, "sampler"),
        ({"prompt": ""}, "prompt"),
        ({"num_frame": 5}, "num_frame.*Extra inputs.*Fix: it is an unknown field; remove it"),
    ],
)
def test_validation_messages_name_value_rule_and_fix(tiny_model, params, match):
    with pytest.raises(ConfigError, match=match) as info:
        front(tiny_model).prepare({"prompt": "a cat", **params})
    assert "Fix" in str(info.value)
