"""``fv generate --lora PATH[:SCALE]``: a LoRA file for one run, recorded in the provenance so
``--replay`` runs it again, bit for bit; bad values refused naming the fix."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.torch import save_file

from fv_core.adapters import random_lora
from fv_core.cli import main

RUN = ["generate", "--model", "wan2.1-t2v-tiny", "--prompt", "a lantern", "--num-frames", "5", "--steps", "2"]
RUN += ["--size", "32x32", "--seed", "3"]


@pytest.fixture(scope="module")
def lora(tmp_path_factory) -> str:
    import fv_core

    dit = fv_core.load("wan2.1-t2v-tiny").instance.component("transformer")
    path = tmp_path_factory.mktemp("lora") / "style.safetensors"
    save_file(random_lora(dit, ("attn1.to_q", "ffn.net.2"), seed=1, std=0.5), path)
    return str(path)


def frames(path) -> np.ndarray:
    import imageio.v3 as iio

    return iio.imread(path)


def test_lora_changes_the_video_and_replays(lora, tmp_path, capsys):
    plain, styled, again = tmp_path / "plain.mp4", tmp_path / "styled.mp4", tmp_path / "again.mp4"
    assert main([*RUN, "-o", str(plain)]) == 0
    assert main([*RUN, "--lora", f"{lora}:0.9", "-o", str(styled)]) == 0
    prov = json.loads(styled.with_suffix(".json").read_text())
    assert [(a["path"], a["scale"]) for a in prov["adapters"]] == [(lora, 0.9)]
    assert not np.array_equal(frames(plain), frames(styled))
    assert main(["generate", "--replay", str(styled.with_suffix(".json")), "-o", str(again)]) == 0
    assert np.array_equal(frames(again), frames(styled))


def test_bad_lora_values_are_refused(lora, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main([*RUN, "--lora", f"{lora}:strong"])
    assert "SCALE 'strong' is not a number. Fix: PATH or PATH:SCALE" in capsys.readouterr().err
    assert main([*RUN, "--lora", str(tmp_path / "missing.safetensors"), "-o", str(tmp_path / "x.mp4")]) != 0
    assert "does not exist" in capsys.readouterr().err
