"""The card contract (fv_core.testing) on three Wan models: the tiny card on its folder, a card that
``fv_core.load`` builds from a folder of another configuration (3 blocks, FlowMatchEuler, shift 5),
and the tiny Wan2.2 T2V A14B card (two experts)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler, WanPipeline

import fv_core
from fv_core.testing import CardContract
from fv_wan.tiny import write_tiny_checkpoint

REQUESTS = [
    dict(prompt="a cat running in the forest", negative_prompt="blurry", num_inference_steps=3, seed=1),
    dict(prompt="a red car in the city", guidance_scale=1.0, num_inference_steps=2, height=48, seed=2),
    dict(prompt="a boat at sunset", num_frames=9, num_inference_steps=2, sampler="euler", seed=3),
]
EULER_SHIFT_5 = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "num_train_timesteps": 1000,
    "shift": 5.0,
    "shift_terminal": 0.2,
}


def euler_folder(path: Path) -> Path:
    """A Wan folder unlike the tiny card: 3 blocks of 2x8 heads and a FlowMatchEuler scheduler (shift 5,
    stretched to end at sigma 0.2)."""
    write_tiny_checkpoint(path, transformer=dict(num_layers=3, attention_head_dim=8), seed=7)
    (path / "scheduler" / "scheduler_config.json").write_text(json.dumps(EULER_SHIFT_5))
    index = json.loads((path / "model_index.json").read_text())
    index["scheduler"] = ["diffusers", "FlowMatchEulerDiscreteScheduler"]
    (path / "model_index.json").write_text(json.dumps(index))
    return path


def reference(folder: str | Path):
    """Diffusers' WanPipeline on ``folder``, driven with fv's resolved params (same sampler and shift)."""
    pipe = WanPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    config = dict(pipe.scheduler.config)

    def run(p: dict) -> np.ndarray:
        """The folder's own scheduler config, with the sampler and shift fv resolved."""
        if p["sampler"] == "unipc":
            pipe.scheduler = UniPCMultistepScheduler.from_config({**config, "flow_shift": p["flow_shift"]})
        elif config["_class_name"] == "FlowMatchEulerDiscreteScheduler":
            pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_config({**config, "shift": p["flow_shift"]})
        else:
            pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=p["flow_shift"])
        return pipe(
            p["prompt"],
            negative_prompt=p["negative_prompt"],
            num_frames=p["num_frames"],
            height=p["height"],
            width=p["width"],
            num_inference_steps=p["num_inference_steps"],
            guidance_scale=p["guidance_scale"],
            guidance_scale_2=p["guidance_scale_2"],
            max_sequence_length=p["max_sequence_length"],
            generator=torch.Generator().manual_seed(p["seed"]),
            output_type="np",
        ).frames[0]

    return run


class TestTinyCard(CardContract):
    @pytest.fixture(scope="class")
    def contract_model(self, wan_host, tiny_path):
        return fv_core.load("wan2.1-t2v-tiny", tiny_path, host=wan_host)

    @pytest.fixture(scope="class")
    def contract_reference(self, tiny_path):
        return reference(tiny_path)

    @pytest.fixture
    def contract_requests(self):
        return REQUESTS


class TestCardBuiltFromAFolder(CardContract):
    contract_affordable = dict(num_frames=5, height=32, width=32, num_inference_steps=3)  # not 81x480x832x50

    @pytest.fixture(scope="class")
    def folder(self, tmp_path_factory):
        return euler_folder(tmp_path_factory.mktemp("wan") / "wan-euler-3")

    @pytest.fixture(scope="class")
    def contract_model(self, wan_host, folder):
        model = fv_core.load(str(folder), host=wan_host)
        assert model.card.model_id == "wan:wan-euler-3" and model.plugin == "fv-wan"
        return model

    @pytest.fixture(scope="class")
    def contract_reference(self, folder):
        return reference(folder)

    @pytest.fixture
    def contract_requests(self):
        small = dict(num_frames=5, height=32, width=32)  # diffusers' defaults (81 x 480 x 832) are slow here
        return [{**small, **r} for r in REQUESTS]

    def test_sampler_and_shift_follow_the_folder(self, contract_model):
        defaults = contract_model.card.programs["t2v"].defaults
        assert defaults["sampler"] == "euler" and defaults["flow_shift"] == 5.0
        assert defaults["num_frames"] == 81 and defaults["height"] == 480  # diffusers' WanPipeline defaults


class TestA14BTinyCard(CardContract):
    @pytest.fixture(scope="class")
    def contract_model(self, wan_host, variant_folders):
        return fv_core.load("wan2.2-t2v-a14b-tiny", variant_folders["t2v-a14b", "first"], host=wan_host)

    @pytest.fixture(scope="class")
    def contract_reference(self, variant_folders):
        return reference(variant_folders["t2v-a14b", "first"])

    @pytest.fixture
    def contract_requests(self):
        return [{**REQUESTS[0], "guidance_scale_2": 2.0}, *REQUESTS[1:]]
