"""Checkpoint layout checks, pickle refusal, sharded safetensors, the embedded tiny weights."""

from __future__ import annotations

import shutil

import pytest
import torch

from fv_core import WeightsError
from fv_wan.checkpoint import check_layout, load_component
from fv_wan.tiny import tiny_weights


@pytest.fixture
def copy(tiny_path, tmp_path):
    target = tmp_path / "ckpt"
    shutil.copytree(tiny_path, target)
    return target


def test_pickle_files_are_refused(copy):
    (copy / "transformer" / "diffusion_pytorch_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(
        WeightsError, match=r"refusing pickle.*diffusion_pytorch_model\.bin.*Fix: convert them to safetensors"
    ):
        check_layout(copy)


def test_missing_folder_lists_expected_layout(tmp_path):
    with pytest.raises(WeightsError, match=r"does not exist(?s:.*)transformer/(?s:.*)scheduler_config\.json"):
        check_layout(tmp_path / "nope")


@pytest.mark.parametrize(
    "break_it,match",
    [
        (lambda p: shutil.rmtree(p / "vae"), "vae/ is missing"),
        (lambda p: (p / "model_index.json").unlink(), "model_index.json is missing"),
        (lambda p: (p / "model_index.json").write_text("{nope"), "not valid JSON"),
        (lambda p: (p / "text_encoder" / "model.safetensors").unlink(), "no \\*.safetensors"),
        (lambda p: (p / "scheduler" / "scheduler_config.json").unlink(), "scheduler_config.json is missing"),
        (lambda p: (p / "tokenizer" / "tokenizer.json").unlink(), "tokenizer.json"),
    ],
)
def test_malformed_layout(copy, break_it, match):
    break_it(copy)
    with pytest.raises(WeightsError, match=match) as info:
        check_layout(copy)
    assert "text_encoder/" in str(info.value)  # the expected layout is listed


def test_sharded_safetensors_load_equal(copy, tiny_model):
    model = tiny_model.component("transformer")
    shutil.rmtree(copy / "transformer")
    model.save_pretrained(copy / "transformer", safe_serialization=True, max_shard_size="100KB")
    assert len(list((copy / "transformer").glob("*.safetensors"))) > 1
    sharded = load_component(copy, "transformer")
    for (name, a), (_, b) in zip(model.state_dict().items(), sharded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    (copy / "transformer" / next((copy / "transformer").glob("*-00001-of-*")).name).unlink()
    with pytest.raises(WeightsError, match="missing shards"):
        check_layout(copy)


def test_tiny_weights_are_deterministic_and_written_once(tiny_path, tmp_path, monkeypatch):
    monkeypatch.setenv("FV_CACHE_DIR", str(tmp_path))
    path = tiny_weights()
    assert path.startswith(str(tmp_path)) and tiny_weights() == path
    for sub in ("transformer/diffusion_pytorch_model.safetensors", "text_encoder/model.safetensors"):
        assert open(f"{path}/{sub}", "rb").read() == open(f"{tiny_path}/{sub}", "rb").read()
