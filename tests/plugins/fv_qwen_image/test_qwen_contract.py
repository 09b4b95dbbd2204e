"""The card contract (fv_core.testing) against diffusers' QwenImagePipeline: the tiny card on its
folder, and a card ``fv_core.load`` builds from a folder of another shape (3 blocks of 3 heads x 8, a
24-wide text encoder), each with true CFG on and off and non-square sizes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import pipeline

import fv_core
from fv_core.testing import CardContract

REQUESTS = [
    dict(
        prompt="a cat holding a sign", negative_prompt=" ", true_cfg_scale=4.0, num_inference_steps=2, seed=1
    ),
    dict(
        prompt="a red car", num_inference_steps=2, height=32, width=48, seed=2
    ),  # no negative prompt: no CFG
    dict(
        prompt="a boat",
        negative_prompt="blurry",
        true_cfg_scale=2.5,
        num_inference_steps=2,
        height=48,
        width=32,
        max_sequence_length=40,
        seed=3,
    ),
]


def reference(folder: str):
    """diffusers' QwenImagePipeline on ``folder`` with fv's resolved params: images [1, H, W, 3]."""
    pipe = pipeline(folder)

    def run(p: dict) -> np.ndarray:
        return pipe(
            p["prompt"],
            negative_prompt=p["negative_prompt"],
            true_cfg_scale=p["true_cfg_scale"],
            height=p["height"],
            width=p["width"],
            num_inference_steps=p["num_inference_steps"],
            max_sequence_length=p["max_sequence_length"],
            generator=torch.Generator().manual_seed(p["seed"]),
            output_type="np",
        ).images

    return run


class TestTinyCard(CardContract):
    @pytest.fixture(scope="class")
    def contract_model(self, tiny_model):
        return tiny_model

    @pytest.fixture(scope="class")
    def contract_reference(self, tiny_path):
        return reference(tiny_path)

    @pytest.fixture
    def contract_requests(self):
        return REQUESTS


class TestCardBuiltFromAFolder(CardContract):
    contract_affordable = dict(height=32, width=48, num_inference_steps=2)  # not 1024 x 1024 x 50

    @pytest.fixture(scope="class")
    def contract_model(self, qwen_host, second_path):
        model = fv_core.load(second_path, host=qwen_host)
        assert model.card.model_id == "qwen-image:qwen-second" and model.plugin == "fv-qwen-image"
        return model

    @pytest.fixture(scope="class")
    def contract_reference(self, second_path):
        return reference(second_path)

    @pytest.fixture
    def contract_requests(self):
        return [{"height": 32, "width": 32, **r} for r in REQUESTS]

    def test_defaults_are_diffusers_pipeline_defaults(self, contract_model):
        defaults = contract_model.card.programs["t2i"].defaults
        assert defaults == dict(
            negative_prompt=None,
            true_cfg_scale=4.0,
            height=1024,
            width=1024,
            num_inference_steps=50,
            max_sequence_length=512,
        )
