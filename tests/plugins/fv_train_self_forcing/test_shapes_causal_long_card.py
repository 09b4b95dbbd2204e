"""The shipped wan2.1-t2v-shapes-causal-long: the shapes VAE's latent space (its encoder) with a decoder for
long videos, and a 33-frame rollout that keeps its colour past the 9 frames the shapes models trained on
(the shapes VAE's decoder reads about half of them wrong from frame 9 on; the student's colour still drifts
on frames 24..32 in a quarter of the rollouts: bench/results/self_forcing_shapes_long.json)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import fv_core
from fv_train_flow.detect import detect
from fv_wan.cards import shapes_causal_long_weights, shapes_weights

CARD = "wan2.1-t2v-shapes-causal-long"


@pytest.fixture(scope="module")
def long_student(wan_only_host):
    return fv_core.load(CARD, host=wan_only_host)


def test_its_vae_keeps_the_shapes_encoder_and_ships_its_own_decoder():
    folder = Path(shapes_causal_long_weights())
    assert sorted(p.name for p in folder.iterdir()) == [
        "fv_recipe.json",
        "model_index.json",
        "transformer",
        "vae",
    ]
    shared = json.loads((folder / "model_index.json").read_text())["_fv_shared"]
    assert shared == {name: f"../shapes/{name}" for name in ("scheduler", "text_encoder", "tokenizer")}
    ours = load_file(folder / "vae/diffusion_pytorch_model.safetensors")
    parent = load_file(Path(shapes_weights()) / "vae/diffusion_pytorch_model.safetensors")
    latent_side = [k for k in parent if k.startswith(("encoder.", "quant_conv."))]
    assert latent_side and all(torch.equal(ours[k], parent[k]) for k in latent_side)
    assert any(not torch.equal(ours[k], parent[k]) for k in parent if k.startswith("decoder."))
    for name in ("latents_mean", "latents_std"):
        assert (
            json.loads((folder / "vae/config.json").read_text())[name]
            == json.loads((Path(shapes_weights()) / "vae/config.json").read_text())[name]
        )


@pytest.mark.parametrize(
    "prompt,seed", [("a blue square moving down", 0), ("a purple circle moving left", 1)]
)
def test_a_33_frame_rollout_keeps_its_colour_to_frame_24(long_student, prompt, seed):
    video = long_student.generate(prompt=prompt, seed=seed)
    assert video.frames.shape == (33, 64, 64, 3)
    assert video.provenance["metrics"]["chunks"] == 9
    frames = torch.from_numpy(video.frames)
    words = prompt.split()  # "a <colour> <shape> moving <direction>"
    assert detect(frames[:9]).direction == words[-1]
    assert (detect(frames[8:17]).colour, detect(frames[8:17]).shape) == (words[1], words[2])
    assert detect(frames[16:25]).colour == words[1]
