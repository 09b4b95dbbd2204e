"""The Python surface: load a card, generate, save mp4 + provenance JSON."""

from __future__ import annotations

import json

import imageio.v2 as imageio
import numpy as np
from wan_support import front

import fv_wan
from fv_core import ImageArtifact


def test_generate_and_save(tiny_model, tiny_path, tmp_path):
    seen = []
    result = fv_wan.generate(
        front(tiny_model),
        prompt="a dog",
        negative_prompt="blurry",
        num_inference_steps=2,
        seed=5,
        cfg_mode="batched",
        progress=lambda step, total: seen.append((step, total)),
    )
    assert result.frames.shape == (5, 32, 32, 3) and result.frames.dtype == np.float32
    assert 0.0 <= result.frames.min() and result.frames.max() <= 1.0
    assert seen[-1] == (2, 2)
    prov = result.provenance
    assert prov["card"] == "wan2.1-t2v-tiny" and prov["params"]["seed"] == 5
    assert prov["recipe"]["assumes_loop"] == "t2v" and prov["task"] == "t2v"
    assert set(prov["weights_hash"]) == {"transformer", "vae", "text_encoder"}
    assert prov["kernels"]["attention"] == "sdpa" and prov["params"]["cfg_mode"] == "batched"

    out = result.save(tmp_path / "out.mp4")
    assert json.loads((tmp_path / "out.json").read_text())["params"]["seed"] == 5
    frames = imageio.mimread(out)
    assert len(frames) == 5 and frames[0].shape == (32, 32, 3)


def test_generate_by_card_id_uses_embedded_weights(tiny_path, monkeypatch):
    monkeypatch.setattr("fv_wan.tiny.tiny_weights", lambda path=None: tiny_path)
    result = fv_wan.generate("wan2.1-t2v-tiny", task="t2i", prompt="a boat", num_inference_steps=1)
    assert isinstance(result, ImageArtifact) and result.image.shape == (32, 32, 3)
    assert result.provenance["task"] == "t2i" and result.provenance["params"]["num_frames"] == 1
