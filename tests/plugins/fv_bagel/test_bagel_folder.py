"""A BAGEL folder in the published layout (no model_index.json) loads by path: ``fv_core.load(folder)``
recognises it through fv-bagel's folder reader and builds its card from the folder's configs and tables.
The folder here is shaped unlike the tiny card's (other layer, head and latent table sizes)."""

from __future__ import annotations

import numpy as np
import pytest

import fv_core
from fv_bagel.tiny import write_checkpoint
from fv_core import ImageArtifact, TextArtifact, WeightsError
from fv_core.request import ImagePart

SHAPE = dict(num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, intermediate_size=96)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("published") / "BAGEL-small"
    write_checkpoint(path, llm=SHAPE, max_latent_size=6, seed=5)
    return path


def test_a_published_folder_loads_by_path_and_generates(bagel_host, folder):
    model = fv_core.load(str(folder), host=bagel_host)
    card = model.card
    assert card.model_id == "bagel:BAGEL-small" and model.plugin == "fv-bagel"
    assert "3 layers" in card.description and card.precision.default == "float32"
    net = model.instance.component("net")
    assert len(net.language_model.model.layers) == 3 and net.max_latent_size == 6
    # the latent table is 6 patches (96 px) a side: the published defaults bounded by it
    t2i, chat = card.programs["t2i"].defaults, card.programs["chat"].defaults
    assert (t2i["height"], t2i["width"], card.capabilities.max_resolution) == (96, 96, (96, 96))
    assert (chat["vae_transform"], chat["vit_transform"]) == ((96, 48, 16), (32, 16, 4))
    image = model.generate(task="t2i", prompt="a red cat", num_inference_steps=3, height=64, width=96)
    assert isinstance(image, ImageArtifact) and image.image.shape == (64, 96, 3)
    picture = ImagePart(np.random.default_rng(0).random((70, 150, 3)).astype(np.float32))
    answer = model.generate(task="chat", parts=[picture], prompt="what is this?", max_tokens=4)
    assert isinstance(answer, TextArtifact) and answer.provenance["metrics"]["completion_tokens"] <= 4
    edited = model.generate(task="edit", parts=[picture], prompt="make it red", num_inference_steps=2)
    assert edited.image.shape == (48, 96, 3)  # 70x150 by (96, 48, 16)


def test_a_folder_no_reader_recognises_names_the_readers_and_the_fix(bagel_host, tmp_path):
    (tmp_path / "llm_config.json").write_text("{}")  # not the whole layout
    with pytest.raises(WeightsError, match=r"no model_index.json.*readers: \['Bagel'\].*Fix"):
        fv_core.load(str(tmp_path), host=bagel_host)
