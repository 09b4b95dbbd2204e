"""clip-score: the CLIP score of transformers' CLIPModel exactly as its docs compute it, a scorer a
workflow's best-of-N selects with, and clear refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fv_core
from fv_core import ConfigError
from fv_core.deploy.card import parse_deploy
from fv_core.plugins import load_plugins


@pytest.fixture(scope="module")
def clip_folder(tmp_path_factory):
    from fv_clip_score.tiny import write_tiny_clip

    return write_tiny_clip(tmp_path_factory.mktemp("clip"), seed=3)


def test_score_is_clips_cosine_as_transformers_computes_it(clip_folder):
    from transformers import CLIPModel, CLIPProcessor

    from fv_clip_score.scorer import ClipScorer

    frames = torch.rand(4, 3, 40, 48, 3, generator=torch.Generator().manual_seed(0))
    prompts = ["a red circle", "blue square", "x", "a green triangle moving up"]
    scores = ClipScorer(str(clip_folder))(frames, prompts)
    # the reference, as transformers' CLIP docs run it: processor(text, images) -> model -> logits_per_image
    model, processor = CLIPModel.from_pretrained(clip_folder), CLIPProcessor.from_pretrained(clip_folder)
    images = list((frames.flatten(0, 1) * 255).round().to(torch.uint8).numpy())
    with torch.no_grad():
        out = model(**processor(text=prompts, images=images, return_tensors="pt", padding=True))
    cos = (out.logits_per_image / model.logit_scale.exp()).view(4, 3, 4)  # [clip, frame, prompt]
    expected = torch.stack([100 * cos[b, :, b].clamp(min=0).mean() for b in range(4)])
    assert torch.allclose(scores, expected, atol=1e-4)
    assert (scores > 0).any() and (scores == 0).any()  # this seed shows both sides of the clamp


def test_best_of_n_selects_by_clip_score(clip_folder):
    host = load_plugins(env={"FV_PLUGINS": "fv-wan,fv-clip-score"})
    deploy = parse_deploy(
        {
            "plugins": ["fv-wan", "fv-clip-score"],
            "determinism": "bitwise",  # candidates equal their solo runs, byte for byte
            "models": [{"card": "wan2.1-t2v-tiny", "name": "wan"}],
            "workflows": {
                "best-still": {
                    "params": {"prompt": None, "seed": 0, "num_inference_steps": 4},
                    "stages": [
                        {
                            "name": "still",
                            "model": "wan",
                            "task": "t2i",
                            "bind": {
                                "prompt": "request.prompt",
                                "seed": "request.seed",
                                "num_inference_steps": "request.num_inference_steps",
                            },
                            "fan_out": 3,
                            "select": {"scorer": "clip-score", "options": {"model": str(clip_folder)}},
                        }
                    ],
                }
            },
        }
    )
    flow = fv_core.load("best-still", deploy=deploy, host=host)
    out = flow.generate(prompt="a lantern", seed=5)
    wan = flow.models["wan"]
    stills = [
        wan.generate(task="t2i", prompt="a lantern", seed=5 + i, num_inference_steps=4) for i in range(3)
    ]
    frames = torch.stack([torch.from_numpy(s.image[None]) for s in stills])
    scores = flow.scorers["still"](frames, ["a lantern"] * 3).tolist()
    chosen = out.provenance["stages"]["still"]
    assert [c["score"] for c in chosen["candidates"]] == pytest.approx(scores)
    assert chosen["selected"] == int(np.argmax(scores)) and chosen["scorer"]["scorer"] == "clip-score"
    assert np.array_equal(out.image, stills[chosen["selected"]].image)


def test_refusals_name_the_value_and_the_fix(tmp_path, clip_folder):
    from fv_clip_score.scorer import ClipScorer

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"no model\.safetensors .*Fix"):
        ClipScorer(str(tmp_path))
    with pytest.raises(ConfigError, match=r"one prompt per clip"):
        ClipScorer(str(clip_folder))(torch.rand(2, 1, 8, 8, 3), ["only one"])
