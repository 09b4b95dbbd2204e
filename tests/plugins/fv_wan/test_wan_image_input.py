"""Image-to-video through the front door: Python ``image=``, ``fv generate --image``, HTTP
``input_reference``; unusable images get clear errors; cache-dit and STA on the new cards."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

import fv_cache_dit.plugin
import fv_core
import fv_sta.plugin
import fv_wan.plugin
from fv_cache_dit import DBCache
from fv_core import ConfigError
from fv_core.deploy.card import parse_deploy
from fv_core.parity import compare_results
from fv_core.plugins import PluginHost
from fv_core.runtime import Engine

I2V = "wan2.1-i2v-tiny"
PIXELS = (np.random.default_rng(3).random((40, 56, 3)) * 255).astype(np.uint8)
FAST = dict(prompt="a red cat", seed=4, num_inference_steps=2, max_sequence_length=16)


@pytest.fixture(scope="module")
def host() -> PluginHost:
    host = PluginHost(env={})
    for module, name in (
        (fv_wan.plugin, "fv-wan"),
        (fv_cache_dit.plugin, "fv-cache-dit"),
        (fv_sta.plugin, "fv-sta"),
    ):
        host.add(module, name)
    return host.collect()


@pytest.fixture(scope="module")
def i2v(host, variant_folders):
    return fv_core.load(I2V, variant_folders["i2v", "first"], host=host)


def test_python_takes_a_pil_image_a_path_or_an_array_alike(i2v, tmp_path):
    Image.fromarray(PIXELS).save(tmp_path / "first.png")
    from_pil = i2v.generate(image=Image.fromarray(PIXELS), **FAST)
    assert from_pil.provenance["task"] == "i2v" and from_pil.provenance["parts"] == ["image"]
    for same in (tmp_path / "first.png", str(tmp_path / "first.png"), PIXELS, PIXELS / 255.0):
        assert np.array_equal(i2v.generate(image=same, **FAST).frames, from_pil.frames)
    other = i2v.generate(image=255 - PIXELS, **FAST)
    assert np.abs(other.frames - from_pil.frames).max() > 1e-3  # the image conditions the video


@pytest.mark.parametrize(
    "image, match",
    [
        (np.zeros((40, 56, 4), np.uint8), r"shape \(40, 56, 4\).*Fix: drop the alpha channel"),
        (np.zeros((8, 56, 3), np.uint8), r"56x8 pixels: each side must be 16 to 8192"),
        (np.full((40, 56, 3), 2.0), r"float images are in 0\.\.1.*Fix: divide by 255"),
        (b"\x89PNG not really", r"not a readable image.*Fix: pass a PNG"),
        ("/nowhere/first.png", r"'/nowhere/first.png' is not a readable image"),
        (np.zeros((40, 56, 3), np.int64), r"dtype int64: images are uint8 or float"),
    ],
)
def test_unusable_images_name_the_value_the_rule_and_the_fix(i2v, image, match):
    with pytest.raises(ConfigError, match=match) as err:
        i2v.generate(image=image, **FAST)
    assert err.value.param == "image"


def test_the_cli_takes_an_image_and_picks_the_image_task(host, variant_folders, tmp_path, monkeypatch):
    from fv_core.cli import main

    monkeypatch.setattr("fv_core.cli.load_plugins", lambda: host)
    Image.fromarray(PIXELS).save(tmp_path / "first.png")
    args = ["generate", "--model", "wan2.2-ti2v-tiny", "--weights", variant_folders["ti2v", "first"]]
    args += ["--prompt", "a cat", "--steps", "2", "--height", "64", "--width", "64"]
    assert main([*args, "--image", str(tmp_path / "first.png"), "-o", str(tmp_path / "i2v.mp4")]) == 0
    assert json.loads((tmp_path / "i2v.json").read_text())["task"] == "i2v"
    assert main([*args, "-o", str(tmp_path / "t2v.mp4")]) == 0  # TI2V: text alone works too
    assert json.loads((tmp_path / "t2v.json").read_text())["task"] == "t2v"
    (tmp_path / "broken.png").write_bytes(b"not an image")
    assert main([*args, "--image", str(tmp_path / "broken.png")]) == 2


def test_the_server_takes_input_reference_as_a_multipart_upload(host, variant_folders, tmp_path):
    import openai

    from tests.serving.support import ServerThread

    deploy = parse_deploy(
        {
            "plugins": ["fv-wan"],
            "models": [{"card": I2V, "weights": variant_folders["i2v", "first"]}],
            "data_dir": str(tmp_path),
        }
    )
    png = io.BytesIO()
    Image.fromarray(PIXELS).save(png, format="PNG")
    with ServerThread(deploy, host) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0)
        job = client.videos.create_and_poll(
            prompt="a red cat", size="48x32", input_reference=("first.png", png.getvalue(), "image/png"),
            extra_body={"num_inference_steps": 2, "max_sequence_length": 16},
        )  # fmt: skip
        assert job.status == "completed", job
        recorded = json.loads(server.service.store.video_path(job.id).with_suffix(".json").read_text())
        assert recorded["task"] == "i2v" and recorded["parts"] == ["image"]
        with pytest.raises(openai.BadRequestError, match="input_reference.*not a readable image"):
            client.videos.create(prompt="a cat", input_reference=("x.png", b"garbage", "image/png"))
        with pytest.raises(openai.BadRequestError, match="exactly one image"):
            client.videos.create(prompt="a cat", extra_body={"num_inference_steps": 2})


def test_cache_dit_keeps_the_interleave_gate_on_i2v_and_a14b(host, variant_folders):
    models = [
        fv_core.load(I2V, variant_folders["i2v", "first"], host=host),
        fv_core.load("wan2.2-i2v-a14b-tiny", variant_folders["i2v-a14b", "first"], host=host),
        fv_core.load("wan2.2-t2v-a14b-tiny", variant_folders["t2v-a14b", "first"], host=host),
    ]
    image = fv_core.request.image_part(PIXELS)
    opts = dict(Fn_compute_blocks=1, Bn_compute_blocks=0, max_warmup_steps=1)

    def items():
        out = []
        for i, model in enumerate(models):
            task = model.card.tasks[0]
            raw = {**FAST, "seed": i, "num_inference_steps": 8, "guidance_scale": 4.0}
            ask = {"fv-cache-dit": {"residual_diff_threshold": 0.2 + 0.2 * i}}
            parts = [image] if task == "i2v" else []
            out.append(
                model.job(model.prepare(raw, task=task, parts=parts, plugin_options=ask, request_id=f"r{i}"))
            )
        return out

    with torch.no_grad():
        serial = Engine(interceptors=[DBCache(**opts)]).run_serial(items())
        interleaved = Engine(interceptors=[DBCache(**opts)]).run_interleaved(items())
    report = compare_results(serial, interleaved, "interleave", tolerance=0.0)
    assert report.ok and report.max_abs == 0.0, str(report)
    stats = [r.metrics["cache_dit"] for r in serial]
    assert all(s["cached"] > 0 for s in stats)  # caching really happened
    # each expert keeps its own caches: the low-noise expert's branches are separate
    assert {"cond@transformer_2", "uncond@transformer_2"} <= set(stats[1]["branches"])


def test_sta_runs_on_the_ti2v_card(host, variant_folders):
    deploy = parse_deploy(
        {
            "plugins": ["fv-wan", "fv-sta"],
            "models": [
                {
                    "card": "wan2.2-ti2v-tiny",
                    "weights": variant_folders["ti2v", "first"],
                    "kernels": {"attention": "sta"},
                }
            ],
            "plugin_options": {"fv-sta": {"windows": [{"tile": [1, 2, 2], "window": [1, 1, 1]}]}},
        }
    )
    model = fv_core.load("wan2.2-ti2v-tiny", deploy=deploy, host=host)
    video = model.generate(image=PIXELS, **{**FAST, "height": 128, "width": 128})
    attention = video.provenance["kernels"]["attention"]
    assert attention["variant"] == "sta" and attention["call"]["grid"] == (2, 4, 4)
    dense = fv_core.load("wan2.2-ti2v-tiny", variant_folders["ti2v", "first"], host=host)
    plain = dense.generate(image=PIXELS, **{**FAST, "height": 128, "width": 128})
    assert (plain.frames != video.frames).any()  # windows smaller than the grid: a different attention


def test_a_decompression_bomb_is_an_unreadable_image(monkeypatch):
    png = io.BytesIO()
    Image.fromarray(PIXELS).save(png, format="PNG")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # 56x40 is then over twice PIL's limit
    with pytest.raises(ConfigError, match="not a readable image.*decompression bomb"):
        fv_core.request.image_part(png.getvalue())
