"""The front door on Qwen-Image: size rules, the text-feature cache, batched steps, a named card on a
folder of another size, `fv generate` to a PNG and `/v1/images/generations` through the openai client."""

from __future__ import annotations

import base64
import io

import numpy as np
import openai
import pytest
from PIL import Image

import fv_core
from fv_core import ConfigError, WeightsError
from fv_core.cli import main
from fv_core.deploy.card import parse_deploy
from fv_core.parity import check_batched_parity
from fv_core.runtime import Engine
from fv_core.runtime.policy import SchedulingPolicy

SMALL = dict(height=32, width=32, num_inference_steps=2)


@pytest.mark.parametrize(
    "size,message",
    [
        (
            dict(height=40),
            r"height=40 must be a multiple of 16 \(VAE x8, patch x2; diffusers would silently shrink",
        ),
        (dict(width=1000), r"width=1000 must be a multiple of 16 .* Fix: use 992"),
    ],
)
def test_sizes_off_the_patch_grid_are_refused(tiny_model, size, message):
    with pytest.raises(ConfigError, match=message) as info:
        tiny_model.generate(prompt="a cat", **size)
    assert info.value.param == next(iter(size))


def test_prompt_features_are_cached_by_content(tiny_model):
    first = tiny_model.generate(prompt="a green bird", negative_prompt="dark", true_cfg_scale=3.0, **SMALL)
    again = tiny_model.generate(prompt="a green bird", negative_prompt="dark", true_cfg_scale=3.0, **SMALL)
    other = tiny_model.generate(prompt="a green bird", negative_prompt="dark", max_sequence_length=5, **SMALL)
    assert (
        first.provenance["metrics"]["text_cache_hits"] == 0
        and again.provenance["metrics"]["text_cache_hits"] == 2
    )
    assert other.provenance["metrics"]["text_cache_hits"] == 0  # another length: other features
    assert np.array_equal(first.image, again.image) and not np.array_equal(first.image, other.image)


class BatchCount:
    """An observer of how many plans each step shared its call with."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def on_step(self, state, plan, result) -> None:
        self.sizes.append(result.batched_with)


def test_same_sized_requests_with_prompts_of_other_lengths_batch(tiny_model):
    """Their steps share one call (prompts zero-padded, each masked to its own) and equal each request
    alone within the card's tolerance."""
    asks = [
        dict(prompt="a cat", seed=1),
        dict(prompt="a dog in the snow at night", seed=2),
        dict(prompt="a cow", seed=3),
    ]

    def items():
        return [
            tiny_model.job(tiny_model.prepare({**SMALL, "negative_prompt": "blur", **a}, request_id=f"b{i}"))
            for i, a in enumerate(asks)
        ]

    steps = BatchCount()
    report = check_batched_parity(
        lambda: Engine(observers=[steps], scheduling=SchedulingPolicy("fair")),
        items,
        tol=tiny_model.card.parity.tolerances["frames"],
    )
    assert report.ok and max(steps.sizes) == 3, steps.sizes


def test_a_named_card_refuses_a_folder_of_another_size(qwen_host, second_path):
    with pytest.raises(WeightsError) as info:
        fv_core.load("qwen-image-tiny", second_path, host=qwen_host)
    assert "expects num_layers=2 in transformer/config.json, the folder has num_layers=3" in str(info.value)
    assert "Fix: load the folder by path" in str(info.value)


def test_cli_generates_a_png_from_the_tiny_card(tiny_path, tmp_path, monkeypatch, qwen_host):
    monkeypatch.setattr("fv_core.cli.load_plugins", lambda: qwen_host)
    out = tmp_path / "x.png"
    assert (
        main(["generate", "--model", "qwen-image-tiny", "--prompt", "a cat", "--steps", "2", "-o", str(out)])
        == 0
    )
    image = np.asarray(Image.open(out))
    assert image.shape == (64, 64, 3)  # the tiny card's default size
    assert (
        main(
            ["generate", "--model", "qwen-image-tiny", "--prompt", "a cat", "--size", "40x32", "-o", str(out)]
        )
        == 2
    )


def test_images_generations_over_http(tiny_path, tmp_path):
    from tests.serving.support import ServerThread

    deploy = parse_deploy(
        {
            "plugins": ["fv-qwen-image"],
            "models": [{"card": "qwen-image-tiny", "weights": tiny_path}],
            "data_dir": str(tmp_path),
        }
    )
    from fv_core.plugins import load_plugins

    with ServerThread(deploy, load_plugins(env={"FV_PLUGINS": "fv-qwen-image"}), api_key="k") as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="k", max_retries=0, timeout=60)
        out = client.images.generate(
            model="qwen-image-tiny",
            prompt="a cat",
            size="48x32",
            extra_body={"num_inference_steps": 2, "seed": 3},
        )
        image = np.asarray(Image.open(io.BytesIO(base64.b64decode(out.data[0].b64_json))))
        assert image.shape == (32, 48, 3)
        with pytest.raises(openai.BadRequestError, match="multiple of 16"):
            client.images.generate(model="qwen-image-tiny", prompt="a cat", size="40x32")


def test_a_folder_of_another_transformer_variant_is_refused(qwen_host, second_path, tmp_path):
    import json
    import shutil

    folder = tmp_path / "distilled"
    shutil.copytree(second_path, folder)
    config = json.loads((folder / "transformer" / "config.json").read_text())
    (folder / "transformer" / "config.json").write_text(json.dumps({**config, "guidance_embeds": True}))
    with pytest.raises(
        WeightsError, match=r"sets \['guidance_embeds'\].*Fix: load a Qwen/Qwen-Image, Qwen-Image-Edit"
    ):
        fv_core.load(str(folder), host=qwen_host)
