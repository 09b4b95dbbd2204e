"""The shipped causal student wan2.1-t2v-shapes-causal: its folder shares the parent's files, its recipe
names the method and teacher, and it draws what it is asked for, chunk by chunk."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import fv_core
from fv_train_flow.detect import detect
from fv_wan.cards import shapes_causal_weights, wan_shapes_causal

CARD = "wan2.1-t2v-shapes-causal"


@pytest.fixture(scope="module")
def student(wan_only_host):
    return fv_core.load(CARD, host=wan_only_host)


def test_the_folder_ships_only_the_transformer_and_its_recipe():
    folder = Path(shapes_causal_weights())
    assert sorted(p.name for p in folder.iterdir()) == ["fv_recipe.json", "model_index.json", "transformer"]
    shared = json.loads((folder / "model_index.json").read_text())["_fv_shared"]
    assert shared == {name: f"../shapes/{name}" for name in ("scheduler", "text_encoder", "tokenizer", "vae")}
    recipe = json.loads((folder / "fv_recipe.json").read_text())
    assert recipe["method"] == "self_forcing" and recipe["parents"] == ["wan2.1-t2v-shapes"]
    defaults = wan_shapes_causal().programs["t2v"].defaults
    for key in (
        "flow_shift",
        "chunk_frames",
        "context_timestep",
        "window_frames",
        "sink_frames",
        "num_frames",
    ):
        assert recipe[key] == defaults[key], key
    assert recipe["timesteps"] == wan_shapes_causal().loops["causal"].steps.fixed_timesteps


@pytest.mark.parametrize(
    "prompt,seed",
    [("a blue square moving down", 0), ("a green circle moving left", 1), ("a purple circle moving up", 2)],
)
def test_it_draws_the_asked_colour_and_direction_at_9_frames(student, prompt, seed):
    video = student.generate(prompt=prompt, seed=seed)
    assert video.frames.shape == (9, 64, 64, 3)
    assert video.provenance["metrics"]["chunks"] == 3
    found = detect(torch.from_numpy(video.frames))
    words = prompt.split()  # "a <colour> <shape> moving <direction>"
    assert (found.colour, found.direction) == (words[1], words[-1])
