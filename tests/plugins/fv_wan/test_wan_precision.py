"""A deploy entry's ``precision``: checked against the card, the model runs in it, provenance and replay keep it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fv_core import ConfigError
from fv_core.deploy.card import parse_deploy
from fv_core.load import load
from fv_core.replay import replay_plan

REQUEST = dict(prompt="a cat", num_inference_steps=2, seed=1)


def deploy(precision: str):
    return parse_deploy(
        {"plugins": ["fv-wan"], "models": [{"card": "wan2.1-t2v-tiny", "precision": precision}]}
    )


def test_the_model_runs_in_the_entrys_precision_and_replays_in_it(wan_host, tmp_path):
    model = load(deploy=deploy("bfloat16"), host=wan_host)
    assert model.instance.dtype == torch.bfloat16
    video = model.generate(**REQUEST)
    assert model.instance.component("transformer").dtype == torch.bfloat16
    assert np.isfinite(video.frames).all() and video.provenance["deploy"]["precision"] == "bfloat16"
    path = video.save(tmp_path / "out.mp4").with_suffix(".json")
    assert replay_plan(wan_host, path).deploy.models[0].precision == "bfloat16"
    default = load("wan2.1-t2v-tiny", host=wan_host).generate(**REQUEST)
    assert default.provenance["deploy"]["precision"] == "float32"


def test_a_precision_the_card_does_not_support_is_refused_with_the_choices(wan_host):
    with pytest.raises(
        ConfigError, match=r"runs in \['float32', 'bfloat16'\], not 'float16'.*Fix: use one of"
    ):
        load(deploy=deploy("float16"), host=wan_host)
