"""The card contract on LTX-2: the tiny card and a card built from a differently shaped folder, video
frames and audio waveform against diffusers' LTX2Pipeline on the same weights, all guidance on."""

from __future__ import annotations

import pytest
import torch
from diffusers import LTX2Pipeline

import fv_core
from fv_core.testing import CardContract

REQUESTS = [
    dict(prompt="a cat playing piano in the rain", negative_prompt="blurry", num_inference_steps=3, seed=1),
    dict(prompt="waves on a beach", guidance_scale=1.0, audio_guidance_scale=1.0, stg_scale=0.0,
         audio_stg_scale=0.0, num_inference_steps=2, seed=2),  # the cond branch alone
    dict(prompt="a dog barking", num_frames=17, width=96, guidance_rescale=0.0, audio_guidance_rescale=0.0,
         modality_scale=1.0, audio_modality_scale=1.0, num_inference_steps=2, seed=3),
    dict(prompt="a drum solo", num_inference_steps=2, sigmas=[1.0, 0.5], seed=4),  # float sigmas
]  # fmt: skip


def reference(folder: str):
    """Diffusers' LTX2Pipeline on ``folder`` with fv's resolved params."""
    pipe = LTX2Pipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)

    def run(p: dict) -> dict:
        out = pipe(
            p["prompt"],
            negative_prompt=p["negative_prompt"],
            height=p["height"],
            width=p["width"],
            num_frames=p["num_frames"],
            frame_rate=p["fps"],
            num_inference_steps=p["num_inference_steps"],
            sigmas=p["sigmas"],
            guidance_scale=p["guidance_scale"],
            stg_scale=p["stg_scale"],
            modality_scale=p["modality_scale"],
            guidance_rescale=p["guidance_rescale"],
            audio_guidance_scale=p["audio_guidance_scale"],
            audio_stg_scale=p["audio_stg_scale"],
            audio_modality_scale=p["audio_modality_scale"],
            audio_guidance_rescale=p["audio_guidance_rescale"],
            spatio_temporal_guidance_blocks=p["spatio_temporal_guidance_blocks"],
            use_cross_timestep=p["use_cross_timestep"],
            decode_timestep=p["decode_timestep"],
            max_sequence_length=p["max_sequence_length"],
            generator=torch.Generator().manual_seed(p["seed"]),
            output_type="np",
        )
        return {"frames": out.frames[0], "audio": out.audio[0].float().numpy()}

    return run


class TestTinyCard(CardContract):
    @pytest.fixture(scope="class")
    def contract_model(self, ltx_host, ltx_path):
        return fv_core.load("ltx2-tiny", ltx_path, host=ltx_host)

    @pytest.fixture(scope="class")
    def contract_reference(self, ltx_path):
        return reference(ltx_path)

    @pytest.fixture
    def contract_requests(self):
        return REQUESTS


class TestCardBuiltFromAFolder(CardContract):
    contract_affordable = dict(
        num_frames=9, height=64, width=64, num_inference_steps=2, max_sequence_length=128
    )  # diffusers' defaults (121 x 512 x 768, 30 steps) are slow here

    @pytest.fixture(scope="class")
    def contract_model(self, ltx_host, ltx3_path):
        model = fv_core.load(ltx3_path, host=ltx_host)
        assert model.card.model_id == "ltx2:ltx2-three-blocks"
        assert model.card.programs["t2av"].defaults["spatio_temporal_guidance_blocks"] == [
            2
        ]  # its last block
        return model

    @pytest.fixture(scope="class")
    def contract_reference(self, ltx3_path):
        return reference(ltx3_path)

    @pytest.fixture
    def contract_requests(self):
        return [{**self.contract_affordable, **r} for r in REQUESTS[:2]]
