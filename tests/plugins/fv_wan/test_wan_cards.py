"""Cards, plugin registration, FastWan recipe teeth, request validation."""

from __future__ import annotations

import pytest
from wan_support import run

from fv_core import ConfigError, RecipeLoopMismatch, UnknownKeyError
from fv_core.plugins import PluginHost
from fv_wan import plugin
from fv_wan.cards import CARDS, fastwan_1_3b, wan_tiny
from fv_wan.generate import card
from fv_wan.loop import resolve_params
from fv_wan.model import WanModel


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


def test_fastwan_refuses_a_50_step_sampler():
    fast = fastwan_1_3b().validate()
    with pytest.raises(RecipeLoopMismatch, match="3 steps"):
        resolve_params(fast, {"prompt": "a cat", "steps": 50})
    with pytest.raises(RecipeLoopMismatch, match="dmd"):
        resolve_params(fast, {"prompt": "a cat", "sampler": "unipc"})


def test_fastwan_three_step_loop_runs(tiny_path):
    fast = WanModel(fastwan_1_3b(), tiny_path)
    result = run(fast, seed=1, guidance=1.0, sampler="dmd", height=32, width=32)
    assert result.metrics["steps"] == 3 and tuple(result.outputs["frames"].shape) == (5, 32, 32, 3)


@pytest.mark.parametrize(
    "params,match",
    [
        ({"num_frames": 6}, "4k\\+1"),
        ({"num_frames": 0}, "4k\\+1"),
        ({"height": 40}, "multiple of 16"),
        ({"width": 8}, "multiple of 16"),
        ({"steps": 0}, "steps"),
        ({"steps": 500}, "1..200"),
        ({"guidance": 99.0}, "guidance"),
        ({"guidance": -1.0}, "guidance"),
        ({"cfg_mode": "triple"}, "cfg_mode"),
        ({"sampler": "ddim"}, "samplers"),
        ({"prompt": None}, "prompt"),
    ],
)
def test_validation_messages(params, match):
    with pytest.raises(ConfigError, match=match):
        resolve_params(wan_tiny(), {"prompt": "a cat", **params})
