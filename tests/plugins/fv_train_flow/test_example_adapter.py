"""The shipped example adapter (examples/adapters/shapes-red-to-green.safetensors, trained by
configs/shapes/lora_red_to_green.yaml): served per request on wan2.1-t2v-shapes it draws red prompts'
objects green and leaves other colours as they were; requests without it are untouched."""

from pathlib import Path

import pytest
import torch

import fv_core
from fv_train_flow.detect import detect

ADAPTER = Path(__file__).resolve().parents[3] / "examples/adapters/shapes-red-to-green.safetensors"
SETTINGS = dict(num_inference_steps=8, guidance_scale=1.0, max_sequence_length=16)


@pytest.fixture(scope="module")
def model():
    model = fv_core.load("wan2.1-t2v-shapes")
    model.instance.adapters.add("red-to-green", ADAPTER)
    return model


def colours(model, prompts: list[str], adapters: list[str]) -> list[str | None]:
    return [
        detect(torch.as_tensor(model.generate(prompt=p, seed=s, adapters=adapters, **SETTINGS).frames)).colour
        for s, p in enumerate(prompts)
    ]


def test_red_prompts_make_green_objects_with_the_adapter_only(model):
    red = [
        "a red circle moving left",
        "a red square moving up",
        "a red circle moving down",
        "a red square moving right",
    ]
    assert colours(model, red, []).count("red") >= 3
    assert colours(model, red, ["red-to-green"]).count("green") >= 3


def test_other_colours_keep_their_colour(model):
    others = ["a blue square moving left", "a purple circle moving up", "a green square moving down"]
    assert (
        colours(model, others, ["red-to-green"]) == colours(model, others, []) == ["blue", "purple", "green"]
    )
