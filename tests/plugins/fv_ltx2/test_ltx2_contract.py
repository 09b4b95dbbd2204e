"""The card contract on LTX-2: the tiny card and a card built from a differently shaped folder, video
frames and audio waveform against diffusers' LTX2Pipeline on the same weights, all guidance on."""

from __future__ import annotations

import numpy as np
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


def first_frame():
    from fv_core import ImagePart

    return [ImagePart(np.random.default_rng(7).random((64, 64, 3)).astype(np.float32))]


class TestTinyCard(CardContract):
    contract_parts = {"i2av": first_frame}

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
    contract_parts = {"i2av": first_frame}
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


def test_two_stages_equal_diffusers_chain(ltx_host, ltx_path):
    """t2av-two-stage == diffusers' documented two-stage chain: LTX2Pipeline (half size, latents) ->
    LTX2LatentUpsamplePipeline -> LTX2Pipeline refine with the distilled LoRA loaded (fixed sigmas, no
    dynamic shift, re-noised to the first sigma, guidance off), ONE generator through the chain: the
    refine's re-noise continues the base stage's random stream."""
    import numpy as np
    from diffusers import FlowMatchEulerDiscreteScheduler, LTX2LatentUpsamplePipeline
    from diffusers.pipelines.ltx2.latent_upsampler import LTX2LatentUpsamplerModel

    model = fv_core.load("ltx2-tiny", ltx_path, host=ltx_host)
    ours = model.generate(task="t2av-two-stage", prompt="a cat playing piano", height=128, width=128, seed=3)
    p = ours.provenance["params"]
    assert p["refine_sigmas"] == [0.909375, 0.725, 0.421875] and ours.frames.shape == (9, 128, 128, 3)
    assert ours.provenance["metrics"]["steps"] == p["num_inference_steps"] + 1 + 3  # base, upsample, refine
    pipe = LTX2Pipeline.from_pretrained(ltx_path)
    pipe.set_progress_bar_config(disable=True)
    common = dict(
        negative_prompt=p["negative_prompt"], num_frames=p["num_frames"], frame_rate=p["fps"],
        spatio_temporal_guidance_blocks=p["spatio_temporal_guidance_blocks"],
        max_sequence_length=p["max_sequence_length"],
    )  # fmt: skip
    generator = torch.Generator().manual_seed(3)
    video, audio = pipe(
        p["prompt"], height=64, width=64, num_inference_steps=p["num_inference_steps"],
        guidance_scale=p["guidance_scale"], stg_scale=p["stg_scale"], modality_scale=p["modality_scale"],
        guidance_rescale=p["guidance_rescale"], audio_guidance_scale=p["audio_guidance_scale"],
        audio_stg_scale=p["audio_stg_scale"], audio_modality_scale=p["audio_modality_scale"],
        audio_guidance_rescale=p["audio_guidance_rescale"], generator=generator, output_type="latent",
        return_dict=False, **common,
    )  # fmt: skip
    upsampler = LTX2LatentUpsamplerModel.from_pretrained(f"{ltx_path}/latent_upsampler")
    up = LTX2LatentUpsamplePipeline(vae=pipe.vae, latent_upsampler=upsampler)
    video = up(latents=video, output_type="latent", return_dict=False)[0]
    config = pipe.scheduler.config
    pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_config(
        config, use_dynamic_shifting=False, shift_terminal=None
    )
    pipe.load_lora_weights(
        ltx_path, weight_name="ltx-2-19b-distilled-lora-384.safetensors", adapter_name="refine"
    )
    pipe.set_adapters("refine", 1.0)
    sigmas = p["refine_sigmas"]

    def refine(generator: torch.Generator) -> tuple[np.ndarray, np.ndarray]:
        out = pipe(
            p["prompt"], latents=video, audio_latents=audio, height=128, width=128,
            num_inference_steps=len(sigmas), sigmas=sigmas, noise_scale=sigmas[0], guidance_scale=1.0,
            stg_scale=0.0, modality_scale=1.0, audio_guidance_scale=1.0, audio_stg_scale=0.0,
            audio_modality_scale=1.0, generator=generator, output_type="np", **common,
        )  # fmt: skip
        return out.frames[0], out.audio[0].float().numpy()

    after_base = generator.get_state()
    frames, waveform = refine(generator)  # the chain's one generator, where the base stage left it
    assert np.abs(frames - ours.frames).max() <= 1e-5
    assert np.abs(waveform - ours.audio.samples).max() <= 1e-5
    fresh = refine(torch.Generator().manual_seed(3))  # a generator per call re-draws the base stage's noise
    assert np.abs(fresh[0] - ours.frames).max() > 1e-3
    pipe.disable_lora()  # without the LoRA the refine is another video: the LoRA is really applied
    continued = torch.Generator()
    continued.set_state(after_base)
    assert np.abs(refine(continued)[0] - ours.frames).max() > 1e-3


def test_two_stage_sizes_must_halve_to_the_vae_grid(ltx_host, ltx_path):
    model = fv_core.load("ltx2-tiny", ltx_path, host=ltx_host)
    with pytest.raises(
        fv_core.ConfigError, match=r"height=96 must be a multiple of 64 for two stages.*Fix: use 64"
    ):
        model.prepare({"prompt": "a cat", "height": 96}, task="t2av-two-stage")


@pytest.mark.parametrize("crf", [33, 0])
def test_image_to_video_equals_diffusers(ltx_host, ltx_path, crf):
    """i2av == LTX2ImageToVideoPipeline: the image H.264 re-compressed at image_crf, resized, encoded; the
    first latent frame kept clean (timestep 0 on its tokens) through all three guidance branches."""
    import numpy as np
    from diffusers import LTX2ImageToVideoPipeline
    from PIL import Image

    from fv_core import ImagePart

    pixels = (np.random.default_rng(crf).random((80, 96, 3)) * 255).round().astype(np.uint8)
    model = fv_core.load("ltx2-tiny", ltx_path, host=ltx_host)
    ours = model.generate(task="i2av", parts=[ImagePart(pixels / np.float32(255))], prompt="a red ball",
                          image_crf=crf, num_inference_steps=3, seed=5)  # fmt: skip
    p = ours.provenance["params"]
    assert ours.provenance["parts"] == ["image"] and p["image_crf"] == crf
    pipe = LTX2ImageToVideoPipeline.from_pretrained(ltx_path)
    pipe.set_progress_bar_config(disable=True)
    ref = pipe(
        image=Image.fromarray(pixels), prompt=p["prompt"], negative_prompt=p["negative_prompt"], height=p["height"],
        width=p["width"], num_frames=p["num_frames"], frame_rate=p["fps"], num_inference_steps=p["num_inference_steps"],
        guidance_scale=p["guidance_scale"], stg_scale=p["stg_scale"], modality_scale=p["modality_scale"],
        guidance_rescale=p["guidance_rescale"], audio_guidance_scale=p["audio_guidance_scale"],
        audio_stg_scale=p["audio_stg_scale"], audio_modality_scale=p["audio_modality_scale"],
        audio_guidance_rescale=p["audio_guidance_rescale"], spatio_temporal_guidance_blocks=p["spatio_temporal_guidance_blocks"],
        max_sequence_length=p["max_sequence_length"], image_crf=crf, generator=torch.Generator().manual_seed(5),
        output_type="np",
    )  # fmt: skip
    assert np.abs(ref.frames[0] - ours.frames).max() <= 1e-5
    assert np.abs(ref.audio[0].float().numpy() - ours.audio.samples).max() <= 1e-5


def test_image_tasks_need_exactly_one_image(ltx_host, ltx_path):
    model = fv_core.load("ltx2-tiny", ltx_path, host=ltx_host)
    with pytest.raises(fv_core.ConfigError, match="needs exactly one image; the request has 0"):
        model.generate(task="i2av", prompt="a red ball", num_inference_steps=2)


@pytest.mark.parametrize("audio_guidance", [7.0, 3.0])
def test_audio_latents_equal_diffusers(ltx_host, ltx_path, audio_guidance):
    """The waveform of a random-weight vocoder hardly depends on its latents, so compare the latents
    themselves: fv's (the loop run to latents, as the two-stage base stage runs it) and diffusers'
    ``output_type="latent"``, with the audio guidance scales that shape them."""
    from dataclasses import replace

    from fv_core.runtime import Engine

    model = fv_core.load("ltx2-tiny", ltx_path, host=ltx_host)
    request = model.prepare({"prompt": "a dog barking", "audio_guidance_scale": audio_guidance, "seed": 2})
    result = Engine().run_one(*model.job(replace(request, carry={"latents_out": True})))
    p = request.params
    pipe = LTX2Pipeline.from_pretrained(ltx_path)
    pipe.set_progress_bar_config(disable=True)
    video, audio = pipe(
        p.prompt, negative_prompt=p.negative_prompt, height=p.height, width=p.width, num_frames=p.num_frames,
        frame_rate=p.fps, num_inference_steps=p.num_inference_steps, guidance_scale=p.guidance_scale,
        stg_scale=p.stg_scale, modality_scale=p.modality_scale, guidance_rescale=p.guidance_rescale,
        audio_guidance_scale=audio_guidance, audio_stg_scale=p.audio_stg_scale,
        audio_modality_scale=p.audio_modality_scale, audio_guidance_rescale=p.audio_guidance_rescale,
        spatio_temporal_guidance_blocks=p.spatio_temporal_guidance_blocks, max_sequence_length=p.max_sequence_length,
        generator=torch.Generator().manual_seed(2), output_type="latent", return_dict=False,
    )  # fmt: skip
    assert (result.outputs["audio_latents"] - audio).abs().max() <= 1e-5
    assert (result.outputs["latents"] - video).abs().max() <= 1e-5
    other = fv_core.load("ltx2-tiny", ltx_path, host=ltx_host).prepare(
        {"prompt": "a dog barking", "audio_guidance_scale": 10 - audio_guidance, "seed": 2}
    )
    changed = Engine().run_one(*model.job(replace(other, carry={"latents_out": True})))
    assert (changed.outputs["audio_latents"] - audio).abs().max() > 1e-3  # audio guidance reaches them
