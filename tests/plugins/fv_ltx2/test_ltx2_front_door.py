"""LTX-2 through the front door: components at C0, bad input, the text cache, batched branches, the
mp4 with its soundtrack from Python, the CLI and the server."""

from __future__ import annotations

import json
import re
import subprocess

import imageio.v2 as imageio
import imageio_ffmpeg
import numpy as np
import pytest
import torch
from diffusers import LTX2Pipeline

import fv_core
from fv_core import ConfigError, WeightsError
from fv_core.parity import check_batched_parity
from fv_core.runtime import Engine
from fv_ltx2.steps import decode_audio_body, decode_video_body, denoise_body, encode_body

TINY = "ltx2-tiny"


@pytest.fixture(scope="module")
def model(ltx_host, ltx_path):
    return fv_core.load(TINY, ltx_path, host=ltx_host)


@pytest.fixture(scope="module")
def pipe(ltx_path):
    pipe = LTX2Pipeline.from_pretrained(ltx_path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def streams(path) -> str:
    """What ffmpeg says the file holds (its stream lines)."""
    out = subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-i", str(path)], capture_output=True, text=True)
    return "\n".join(line for line in out.stderr.splitlines() if "Stream #" in line)


def test_c0_components_equal_the_pipelines(model, pipe):
    inst = model.instance
    tok = inst.component("tokenizer")
    enc = tok(["a cat"], padding="max_length", max_length=128, return_tensors="pt", padding_side="left")
    with torch.no_grad():
        inputs = {"input_ids": enc.input_ids, "mask": enc.attention_mask}
        ours = encode_body(inst.component("text_encoder"), inst.component("connectors"), inputs)
        embeds, mask, _, _ = pipe.encode_prompt(
            "a cat", do_classifier_free_guidance=False, max_sequence_length=128
        )
        video, audio, text_mask = pipe.connectors(embeds, mask, padding_side="left")
        assert torch.equal(ours["video_text"], video) and torch.equal(ours["audio_text"], audio)
        g = torch.Generator().manual_seed(0)
        latents, audio_latents = torch.randn(1, 8, 4, generator=g), torch.randn(1, 9, 4, generator=g)
        video_coords = pipe.transformer.rope.prepare_video_coords(1, 2, 2, 2, "cpu", fps=24.0)
        audio_coords = pipe.transformer.audio_rope.prepare_audio_coords(1, 9, "cpu")
        statics = dict(num_frames=2, height=2, width=2, fps=24.0, audio_num_frames=9, use_cross_timestep=True)
        inputs = dict(
            latents=latents, audio_latents=audio_latents, video_text=video, audio_text=audio, text_mask=text_mask,
            timestep=torch.tensor([700.0]), video_coords=video_coords, audio_coords=audio_coords,
        )  # fmt: skip
        mine = denoise_body(
            inst.component("transformer"), {**statics, "isolate_modalities": True}, "modality", inputs
        )
        ref_v, ref_a = pipe.transformer(
            hidden_states=latents, audio_hidden_states=audio_latents, encoder_hidden_states=video,
            audio_encoder_hidden_states=audio, timestep=torch.tensor([700.0]), sigma=torch.tensor([700.0]),
            encoder_attention_mask=text_mask, audio_encoder_attention_mask=text_mask, video_coords=video_coords,
            audio_coords=audio_coords, isolate_modalities=True, return_dict=False, **statics,
        )  # fmt: skip
        assert torch.equal(mine["video"], ref_v.float()) and torch.equal(mine["audio"], ref_a.float())
        z = torch.randn(1, 4, 2, 2, 2, generator=g)
        frames = decode_video_body(inst.component("vae"), {"latents": z})["frames"][0].numpy()
        vae = pipe.vae
        ref = vae.decode(
            pipe._denormalize_latents(z, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
        )
        assert np.array_equal(frames, pipe.video_processor.postprocess_video(ref.sample, output_type="np")[0])
        packed = torch.randn(1, 9, 4, generator=g)
        wave = decode_audio_body(inst.component("audio_vae"), inst.component("vocoder"),
                                 {"audio_latents": packed, "latent_mel_bins": 2})["audio"]  # fmt: skip
        unpacked = pipe._unpack_audio_latents(
            pipe._denormalize_audio_latents(packed, pipe.audio_vae.latents_mean, pipe.audio_vae.latents_std),
            9,
            2,
        )
        assert torch.equal(wave, pipe.vocoder(pipe.audio_vae.decode(unpacked).sample).float())


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"num_frames": 10}, r"num_frames=10 must be 8k\+1.*Fix: use 9"),
        ({"height": 80}, r"height=80 must be a multiple of 32.*Fix: use 64"),
        ({"spatio_temporal_guidance_blocks": [5]}, r"blocks \[5\] do not exist; 'ltx2-tiny' has blocks 0..1"),
        ({"sigmas": [1.0, 0.5]}, r"sigmas has 2 values for num_inference_steps=4"),
        ({"max_sequence_length": 200}, r"max_sequence_length=200 must be a multiple of 128.*Fix: use 128"),
        ({"fps": 0}, r"fps: Input should be greater than 0"),
        ({"num_frames": 129}, r"num_frames=129 exceeds this card's max_frames=121"),
        ({"height": 544, "width": 512}, r"size 512x544 exceeds this card's max resolution 512x512.*Fix"),
        ({"num_inference_steps": 1}, r"runs 2..200 steps; got 1"),  # one step stretches to a NaN sigma
    ],
)
def test_bad_input_names_the_value_the_rule_and_the_fix(model, params, match):
    with pytest.raises(ConfigError, match=match):
        model.prepare({"prompt": "a cat", **params})


def test_a_named_card_refuses_a_differently_shaped_folder(ltx_host, ltx3_path):
    with pytest.raises(
        WeightsError, match="expects num_layers=2 in transformer/config.json, the folder has num_layers=3"
    ):
        fv_core.load(TINY, ltx3_path, host=ltx_host)


def test_branches_that_are_no_ops_do_not_run_and_the_text_cache_hits(model):
    off = model.generate(prompt="a quiet room", guidance_scale=1.0, audio_guidance_scale=1.0, stg_scale=0.0,
                         audio_stg_scale=0.0, modality_scale=1.0, audio_modality_scale=1.0, num_inference_steps=2)  # fmt: skip
    assert (
        off.provenance["metrics"]["branches"] == ["cond"] and not off.provenance["metrics"]["stg_from_cond"]
    )
    again = model.generate(prompt="a quiet room", num_inference_steps=2)
    # the tiny transformer has no perturbed attention: STG's call would be the cond call, so it is not made
    assert again.provenance["metrics"]["branches"] == ["cfg", "modality"]
    assert again.provenance["metrics"]["stg_from_cond"]
    assert again.provenance["metrics"]["text_cache_hits"] == 1  # the prompt row; the empty negative is new
    assert again.provenance["metrics"]["kv_cache_hits"] == 1  # the prompt row's, made by the first request
    third = model.generate(prompt="a quiet room", num_inference_steps=2, seed=9)
    assert third.provenance["metrics"]["text_cache_hits"] == third.provenance["metrics"]["kv_cache_hits"] == 2


def test_requests_batch_branch_by_branch_within_tolerance(model):
    def items():
        asks = [
            dict(seed=1),
            dict(seed=2, prompt="rain on a roof"),
            dict(seed=3, stg_scale=0.0, audio_stg_scale=0.0),
        ]
        return [
            model.job(model.prepare({"prompt": "a cat", "num_inference_steps": 2, **a}, request_id=f"b{i}"))
            for i, a in enumerate(asks)
        ]

    report = check_batched_parity(Engine, items, tol=1e-5)
    assert report.ok, str(report)


def test_the_mp4_holds_the_video_and_its_soundtrack_in_sync(model, tmp_path):
    video = model.generate(prompt="a drum solo", num_frames=17, num_inference_steps=2)
    assert video.audio is not None and video.audio.sample_rate == 24000
    assert abs(video.audio.seconds - 17 / 24) < 0.1  # the audio covers the clip
    path = video.save(tmp_path / "drums.mp4")
    found = streams(path)
    assert re.search(r"Video: h264", found) and re.search(r"Audio: aac.*24000 Hz", found), found
    assert len(imageio.mimread(path)) == 17  # every frame is kept (the sound is padded to the last one)
    assert json.loads(path.with_suffix(".json").read_text())["params"]["num_frames"] == 17


def test_cli_writes_an_mp4_with_sound_and_a_wav(ltx_host, ltx_path, tmp_path, monkeypatch):
    from fv_core.cli import main

    monkeypatch.setattr("fv_core.cli.load_plugins", lambda: ltx_host)
    out, wav = tmp_path / "out.mp4", tmp_path / "out.wav"
    args = ["generate", "--model", TINY, "--weights", ltx_path, "--prompt", "a cat", "--steps", "2"]
    assert main([*args, "-o", str(out), "--audio-out", str(wav)]) == 0
    assert "Audio: aac" in streams(out) and wav.stat().st_size > 1000
    assert main([*args, "--frames", "10"]) == 2
    from PIL import Image

    Image.fromarray(np.full((64, 64, 3), 200, np.uint8)).save(tmp_path / "first.png")
    assert main([*args, "--image", str(tmp_path / "first.png"), "-o", str(tmp_path / "i2av.mp4")]) == 0
    assert json.loads((tmp_path / "i2av.json").read_text())["task"] == "i2av"  # the image picked the task


def test_the_server_returns_the_mp4_with_sound(ltx_host, ltx_path, tmp_path):
    import openai

    from fv_core.deploy.card import parse_deploy
    from tests.serving.support import ServerThread

    deploy = parse_deploy(
        {"plugins": ["fv-ltx2"], "models": [{"card": TINY, "weights": ltx_path}], "data_dir": str(tmp_path)}
    )
    with ServerThread(deploy, ltx_host) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0)
        job = client.videos.create_and_poll(
            prompt="a dog barking", size="64x64", extra_body={"num_inference_steps": 2, "stg_scale": 0.5}
        )
        assert job.status == "completed" and job.seconds == "0.375", job  # 9 frames at 24 fps
        client.videos.download_content(job.id).write_to_file(tmp_path / "dog.mp4")
        assert "Audio: aac" in streams(tmp_path / "dog.mp4")
        with pytest.raises(openai.BadRequestError, match="num_frames=10 must be 8k"):
            client.videos.create(prompt="a dog", extra_body={"num_frames": 10})
        import io

        from PIL import Image

        png = io.BytesIO()
        Image.fromarray(np.full((64, 64, 3), 90, np.uint8)).save(png, format="PNG")
        job = client.videos.create_and_poll(
            prompt="a dog", size="64x64", input_reference=("first.png", png.getvalue(), "image/png"),
            extra_body={"num_inference_steps": 2},
        )  # fmt: skip
        assert job.status == "completed", job
        recorded = json.loads(server.service.store.video_path(job.id).with_suffix(".json").read_text())
        assert recorded["task"] == "i2av" and recorded["parts"] == ["image"]
