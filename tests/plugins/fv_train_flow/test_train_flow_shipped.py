"""The shipped shapes model loads from fv-wan's package data and generates through `fv generate`."""

import json

import imageio.v3 as iio
import numpy as np
import torch

from fv_core.cli import main
from fv_core.plugins import PluginHost
from fv_train_flow.detect import detect
from fv_wan.cards import shapes_weights, wan_shapes


def test_shapes_card_is_registered_with_embedded_weights():
    from fv_wan import plugin

    host = PluginHost(env={})
    host.add(plugin, "fv-wan")
    host.collect()
    assert host.card("wan2.1-t2v-shapes").default_weights == "fv_wan.cards:shapes_weights"
    assert "TRAINED" in wan_shapes().description


def test_shipped_model_generates_what_was_asked_through_fv_generate(tmp_path):
    out = tmp_path / "red.mp4"
    assert main(["generate", "--model", "wan2.1-t2v-shapes", "--prompt", "a red square moving right",
                 "--seed", "3", "-o", str(out)]) == 0  # fmt: skip
    provenance = json.loads(out.with_suffix(".json").read_text())
    assert provenance["card"] == "wan2.1-t2v-shapes" and provenance["weights"] == shapes_weights()
    frames = torch.from_numpy(np.asarray(iio.imread(out)).astype(np.float32) / 255)
    assert frames.shape == (9, 64, 64, 3)
    found = detect(frames)
    assert (found.colour, found.direction) == ("red", "right"), found
