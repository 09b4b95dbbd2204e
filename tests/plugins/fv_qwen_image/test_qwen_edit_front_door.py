"""The front door of the edit cards: the output size from the image, bad input, the feature cache keyed
by the image's content, the interleave gate, `fv generate --image` and `/v1/images/edits` through the
openai client (n > 1, seeds, 400s)."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import openai
import pytest
import torch
from conftest import picture
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions
from PIL import Image

import fv_core
from fv_core import ConfigError
from fv_core.cli import main
from fv_core.deploy.card import parse_deploy
from fv_core.parity import compare_results
from fv_core.request import image_part
from fv_core.runtime import Engine

WIDE, TALL = picture(60, 40, 1), picture(36, 52, 2)  # the parity tests' images: their latents are cached
SMALL = dict(height=32, width=48, num_inference_steps=2)


def png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def init(model, images, **params):
    """The edit loop's state for a request (its size, its cache hits): no step runs."""
    request = model.prepare({"prompt": "make it blue", **params}, parts=[image_part(i) for i in images])
    return model.loop("edit").init(request)


def test_the_output_size_defaults_from_the_last_image_as_diffusers(edit_model, plus_model):
    width, height, _ = calculate_dimensions(1024 * 1024, 60 / 40)
    state = init(edit_model, [WIDE])
    assert (state.values["width"], state.values["height"]) == (width, height) == (1248, 832)
    assert init(edit_model, [WIDE], height=64).values["height"] == 64
    plus = plus_model
    width, height, _ = calculate_dimensions(1024 * 1024, 36 / 52)
    assert (init(plus, [WIDE, TALL]).values["width"], init(plus, [WIDE, TALL]).values["height"]) == (
        width,
        height,
    )


def test_bad_input_is_refused_naming_the_fix(edit_model, plus_model):
    with pytest.raises(ConfigError, match="needs exactly one image; the request has 0") as info:
        edit_model.generate(prompt="make it blue", **SMALL)
    assert info.value.param == "image"
    with pytest.raises(ConfigError, match="needs exactly one image; the request has 2"):
        edit_model.generate(prompt="x", parts=[image_part(WIDE), image_part(TALL)], **SMALL)
    with pytest.raises(ConfigError, match=r"height=40 must be a multiple of 16 .* Fix: use 32"):
        edit_model.generate(image=WIDE, prompt="x", height=40, width=48)
    with pytest.raises(ConfigError, match="exceeds this card's max resolution 1280x1280"):
        edit_model.generate(image=WIDE, prompt="x", height=2048, width=2048)
    with pytest.raises(ConfigError, match="each side must be 16 to 8192 pixels"):
        image_part(np.zeros((9000, 16, 3), np.uint8))
    for count in (0, 5):
        with pytest.raises(ConfigError, match=f"an edit takes 1 to 4 images; the request has {count}"):
            init(plus_model, [WIDE] * count)


def test_features_are_cached_by_the_image_content(edit_model):
    edit_model.generate(image=WIDE, prompt="make it blue", negative_prompt=" ", seed=1, **SMALL)
    again = init(edit_model, [WIDE], negative_prompt=" ")
    assert (again.values["cache_hits"], again.values["image_cache_hits"]) == (2, 1)
    changed = np.asarray(WIDE).copy()
    changed[:8, :8] = 255 - changed[:8, :8]
    other = init(edit_model, [Image.fromarray(changed)], negative_prompt=" ")
    assert (other.values["cache_hits"], other.values["image_cache_hits"]) == (0, 0)


def test_edits_interleaved_equal_edits_run_serially(edit_model):
    asks = [  # true CFG on and off, two output sizes
        dict(prompt="make it blue", negative_prompt=" ", true_cfg_scale=4.0, seed=1, **SMALL),
        dict(prompt="a hat", seed=2, height=48, width=32, num_inference_steps=2),
    ]

    def items():
        return [
            edit_model.job(edit_model.prepare(a, parts=[image_part(WIDE)], request_id=f"e{i}"))
            for i, a in enumerate(asks)
        ]

    with torch.no_grad():
        serial = Engine().run_serial(items())
        interleaved = Engine().run_interleaved(items())
    report = compare_results(serial, interleaved, "interleave", tolerance=0.0)
    assert report.ok and report.max_abs == 0.0, str(report)
    assert serial[1].outputs["frames"].shape[1:3] == (48, 32)


def test_cli_edits_an_image_to_a_png(edit_path, edit_model, tmp_path, monkeypatch, qwen_host):
    monkeypatch.setattr("fv_core.cli.load_plugins", lambda: qwen_host)
    src, out = tmp_path / "in.png", tmp_path / "out.png"
    WIDE.save(src)
    base = ["generate", "--model", "qwen-image-edit-tiny", "--prompt", "make it blue", "-o", str(out)]
    assert main([*base, "--image", str(src), "--size", "48x32", "--steps", "2", "--seed", "4"]) == 0
    want = edit_model.generate(image=WIDE, prompt="make it blue", seed=4, **SMALL)
    assert np.array_equal(np.asarray(Image.open(out)), np.asarray(Image.open(io.BytesIO(png_of(want.image)))))
    assert main(base) == 2  # no image


def test_cli_takes_several_images_in_order_for_edit_plus(
    plus_second_path, plus_model, tmp_path, monkeypatch, qwen_host
):
    monkeypatch.setattr("fv_core.cli.load_plugins", lambda: qwen_host)
    first, second, out = tmp_path / "1.png", tmp_path / "2.png", tmp_path / "out.png"
    WIDE.save(first)
    TALL.save(second)
    args = ["generate", "--model", plus_second_path, "--prompt", "both", "--size", "48x32", "--steps", "2"]
    assert main([*args, "--seed", "4", "--image", str(first), "--image", str(second), "-o", str(out)]) == 0
    want = plus_model.generate(parts=[image_part(WIDE), image_part(TALL)], prompt="both", seed=4, **SMALL)
    assert np.array_equal(np.asarray(Image.open(out)), np.asarray(Image.open(io.BytesIO(png_of(want.image)))))
    five = [flag for _ in range(5) for flag in ("--image", str(first))]
    assert main([*args, *five, "-o", str(out)]) == 2  # Plus takes 1 to 4


def png_of(image: np.ndarray) -> bytes:
    from fv_core.serving.media import encode_png

    return encode_png(image)


def test_images_edits_over_http(edit_path, edit_model, tmp_path):
    from fv_core.plugins import load_plugins
    from tests.serving.support import ServerThread

    deploy = parse_deploy(
        {
            "plugins": ["fv-qwen-image"],
            "models": [
                {"card": "qwen-image-edit-tiny", "weights": edit_path},
                {"card": "qwen-image-edit-plus-tiny"},
            ],
            "limits": {"max_running": 1},  # n images one after another: the image is encoded once
            "data_dir": str(tmp_path),
        }
    )
    with ServerThread(deploy, load_plugins(env={"FV_PLUGINS": "fv-qwen-image"}), api_key="k") as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="k", max_retries=0, timeout=120)
        out = client.images.edit(
            model="qwen-image-edit-tiny",
            image=("in.png", png(WIDE), "image/png"),
            prompt="make it blue",
            n=2,
            size="48x32",
            extra_body={"num_inference_steps": 2, "seed": 7},
        )
        for i, data in enumerate(out.data):  # seeds 7 and 8
            want = edit_model.generate(image=WIDE, prompt="make it blue", seed=7 + i, **SMALL).image
            assert base64.b64decode(data.b64_json) == png_of(want)
        bad = [
            (dict(image=[("a.png", png(WIDE), "image/png"), ("b.png", png(TALL), "image/png")]), "exactly one image"),
            (dict(image=("in.png", png(WIDE), "image/png"), size="40x32"), "multiple of 16"),
            (dict(image=("in.png", png(Image.new("RGB", (9000, 16))), "image/png")), "8192"),
        ]  # fmt: skip
        for kwargs, words in bad:
            with pytest.raises(openai.BadRequestError, match=words):
                client.images.edit(model="qwen-image-edit-tiny", prompt="x", **kwargs)
        two = [("1.png", png(WIDE), "image/png"), ("2.png", png(TALL), "image/png")]
        out = client.images.edit(
            model="qwen-image-edit-plus-tiny",
            prompt="both",
            image=two,
            size="48x32",
            extra_body={"num_inference_steps": 2, "seed": 3},
        )
        plus = fv_core.load(
            "qwen-image-edit-plus-tiny", host=load_plugins(env={"FV_PLUGINS": "fv-qwen-image"})
        )
        want = plus.generate(parts=[image_part(WIDE), image_part(TALL)], prompt="both", seed=3, **SMALL).image
        assert base64.b64decode(out.data[0].b64_json) == png_of(want)  # both files, in order
        five = [(f"{i}.png", png(WIDE), "image/png") for i in range(5)]  # every file reaches Plus's loop
        with pytest.raises(openai.BadRequestError, match="an edit takes 1 to 4 images; the request has 5"):
            client.images.edit(model="qwen-image-edit-plus-tiny", prompt="x", image=five, size="48x32")
        answer = httpx.post(
            f"{server.url}/v1/images/edits",
            data={"model": "qwen-image-edit-tiny", "prompt": "x"},
            files={"unused": ("a.txt", b"a", "text/plain")},
            headers={"Authorization": "Bearer k"},
        )
        assert answer.status_code == 400 and "image" in answer.json()["error"]["message"]
