"""The front door on Wan: named cards checked against their folder, defaults following the folder,
deploy limits and options, input parts, replay from provenance, the CLI and `fv cards --json`."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_wan_contract import euler_folder

import fv_core
from fv_core import ConfigError, ImagePart, LimitExceeded, WeightsError
from fv_core.cli import main
from fv_core.deploy.card import parse_deploy
from fv_core.replay import replay_plan

TINY = "wan2.1-t2v-tiny"


@pytest.fixture(scope="module")
def euler_path(tmp_path_factory):
    return euler_folder(tmp_path_factory.mktemp("wan") / "wan-euler-3")


@pytest.fixture(scope="module")
def tiny(wan_host, tiny_path):
    return fv_core.load(TINY, tiny_path, host=wan_host)


def test_a_named_card_refuses_a_folder_of_another_size(wan_host, tiny_path):
    with pytest.raises(WeightsError) as info:
        fv_core.load("wan2.1-t2v-14b", tiny_path, host=wan_host)
    message = str(info.value)
    assert "expects num_layers=40 in transformer/config.json, the folder has num_layers=2" in message
    assert "expects d_model=4096 in text_encoder/config.json, the folder has d_model=32" in message
    assert "Fix: load the folder by path" in message and tiny_path in message


def test_a_named_card_refuses_a_folder_of_another_pipeline(wan_host, tiny_path, tmp_path):
    import shutil

    folder = tmp_path / "other"
    shutil.copytree(tiny_path, folder)
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "_class_name": "LTX2Pipeline"}))
    with pytest.raises(
        WeightsError, match="expects _class_name='WanPipeline'.*has _class_name='LTX2Pipeline'"
    ):
        fv_core.load(TINY, folder, host=wan_host)
    with pytest.raises(WeightsError, match="no installed plugin reads that pipeline"):
        fv_core.load(str(folder), host=wan_host)


def test_the_default_sampler_follows_the_folders_scheduler(wan_host, tiny_path, euler_path, tmp_path):
    import shutil

    folder = tmp_path / "tiny-euler"
    shutil.copytree(tiny_path, folder)
    shutil.copy(euler_path / "scheduler" / "scheduler_config.json", folder / "scheduler")
    model = fv_core.load(TINY, folder, host=wan_host)
    video = model.generate(prompt="a cat", num_inference_steps=3)
    assert (
        video.provenance["params"]["sampler"] == "euler" and video.provenance["params"]["flow_shift"] == 5.0
    )
    unipc = fv_core.load(TINY, tiny_path, host=wan_host).prepare({"prompt": "a cat"}).params
    assert unipc.sampler == "unipc" and unipc.flow_shift == 3.0


def test_provenance_holds_every_resolved_param_and_replays_bit_for_bit(wan_host, tiny):
    first = tiny.generate(prompt="a dog on the beach", num_inference_steps=2, seed=4)
    prov = first.provenance
    assert set(prov["params"]) == set(type(tiny.prepare({"prompt": "x"}).params).model_fields)
    assert prov["params"]["max_sequence_length"] == 512 and prov["params"]["num_frames"] == 5
    assert prov["card"] == TINY and prov["weights_hash"]["transformer"] and "fv-wan" in prov["versions"]
    plan = replay_plan(wan_host, _write(prov))
    again = fv_core.load(plan.model, plan.weights, deploy=plan.deploy, host=wan_host).generate(
        task=plan.task, **plan.params
    )
    assert np.array_equal(first.frames, again.frames)
    other = tiny.generate(prompt="a dog on the beach", num_inference_steps=2, seed=5)
    assert not np.array_equal(first.frames, other.frames)


def _write(prov: dict) -> str:
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prov, f)
    return f.name


def test_deploy_limits_and_plugin_options_apply_through_load(wan_host, tiny_path):
    deploy = parse_deploy(
        {"plugins": ["fv-wan"], "models": [{"card": TINY, "weights": tiny_path}], "limits": {"max_frames": 5}}
    )
    model = fv_core.load(TINY, deploy=deploy, host=wan_host)
    with pytest.raises(
        LimitExceeded, match="num_frames=9 exceeds this deployment's limit max_frames=5"
    ) as info:
        model.prepare({"prompt": "a cat", "num_frames": 9})
    assert info.value.param == "num_frames"
    with pytest.raises(ConfigError, match="'fv-sta', which this deployment does not enable"):
        model.prepare({"prompt": "a cat"}, plugin_options={"fv-sta": {}})


def test_parts_a_task_does_not_take_are_refused(tiny):
    image = ImagePart(np.zeros((32, 32, 3), np.float32))
    with pytest.raises(
        ConfigError, match=r"task 't2v' of 'wan2.1-t2v-tiny' takes input parts none.*\['image'\]"
    ):
        tiny.prepare({"prompt": "a cat"}, parts=[image])
    with pytest.raises(ConfigError, match="has no task 'i2v'; its tasks are \\['t2v', 't2i'\\]"):
        tiny.prepare({"prompt": "a cat"}, task="i2v")


def test_cli_generates_from_a_folder_and_replays(euler_path, tmp_path, monkeypatch, wan_host):
    monkeypatch.setattr("fv_core.cli.load_plugins", lambda: wan_host)
    out = tmp_path / "a.mp4"
    args = ["generate", "--weights", str(euler_path), "--prompt", "a cat", "--steps", "2", "--size", "32x32"]
    assert main([*args, "--frames", "5", "-o", str(out)]) == 0
    prov = json.loads(out.with_suffix(".json").read_text())
    assert prov["card"] == "wan:wan-euler-3" and prov["params"]["sampler"] == "euler"
    assert prov["params"]["num_inference_steps"] == 2 and prov["params"]["width"] == 32
    assert main(["generate", "--replay", str(out.with_suffix(".json")), "-o", str(tmp_path / "b.mp4")]) == 0
    assert json.loads((tmp_path / "b.json").read_text())["params"] == prov["params"]
    assert (tmp_path / "b.mp4").read_bytes() == out.read_bytes()  # same frames, same encoder: same file
    assert main(["generate", "--model", TINY, "--prompt", "a cat", "--frames", "6"]) == 2  # 4k+1
    assert main(["generate", "--model", TINY, "--prompt", "a cat", "--audio-out", "a.wav"]) == 2  # no sound
    assert main(["generate", "--model", TINY, "--prompt", "a cat", "-o", str(tmp_path / "x.wav")]) == 2


def test_cli_refuses_a_device_this_machine_lacks(tmp_path, monkeypatch, wan_host, capsys):
    monkeypatch.setattr("fv_core.cli.load_plugins", lambda: wan_host)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for device, says in (("gpu0", "is not a torch device"), (f"cuda:{gpus}", "Fix:")):
        out = tmp_path / "x.mp4"
        assert (
            main(["generate", "--model", TINY, "--prompt", "a cat", "--device", device, "-o", str(out)]) == 2
        )
        err = capsys.readouterr().err
        assert f"device={device!r}" in err and says in err
        assert not out.exists()


def test_cards_json_prints_each_task_schema_with_the_cards_defaults(monkeypatch, wan_host, capsys):
    monkeypatch.setattr("fv_core.cli.load_plugins", lambda: wan_host)
    assert main(["cards", "--json"]) == 0
    cards = {c["model_id"]: c for c in json.loads(capsys.readouterr().out)}
    shapes = cards["wan2.1-t2v-shapes"]["tasks"]["t2v"]["params"]
    assert shapes["properties"]["num_inference_steps"]["default"] == 30
    assert shapes["properties"]["max_sequence_length"]["default"] == 16
    assert shapes["required"] == ["prompt", "sampler", "flow_shift"]  # the last two follow the folder
    assert cards["wan2.1-t2v-shapes"]["tasks"]["t2i"]["params"]["properties"]["num_frames"]["default"] == 1


def test_replay_reproduces_interceptors_with_the_options_that_ran(tiny_path):
    import fv_cache_dit.plugin
    from fv_core.plugins import PluginHost
    from fv_wan import plugin

    host = PluginHost(env={})
    host.add(plugin, "fv-wan")
    host.add(fv_cache_dit.plugin, "fv-cache-dit")
    host.collect()
    deploy = parse_deploy(
        {
            "plugins": ["fv-wan", "fv-cache-dit"],
            "models": [{"card": TINY, "weights": tiny_path, "interceptors": ["fbcache"]}],
            "plugin_options": {"fv-cache-dit": {"residual_diff_threshold": 0.5, "max_warmup_steps": 1}},
            "limits": {"max_guidance": 30},
        }
    )
    first = fv_core.load(TINY, deploy=deploy, host=host).generate(
        prompt="a cat", num_inference_steps=6, guidance_scale=25.0
    )
    prov = first.provenance
    assert prov["interceptors"] == ["fbcache"] and prov["metrics"]["cache_dit"]["cached"] > 0
    assert prov["plugin_options"] == {"fv-cache-dit": {"residual_diff_threshold": 0.5, "max_warmup_steps": 1}}
    plan = replay_plan(host, _write(prov))  # guidance 25 passes: the replay keeps the deployment's limits
    again = fv_core.load(plan.model, plan.weights, deploy=plan.deploy, host=host).generate(
        task=plan.task, plugin_options=plan.plugin_options, **plan.params
    )
    assert np.array_equal(first.frames, again.frames)
    assert again.provenance["metrics"]["cache_dit"] == prov["metrics"]["cache_dit"]


def test_validate_checks_each_models_weights_as_load_would(wan_host, tiny_path, tmp_path):
    import shutil

    from fv_core.deploy import check_deploy

    pickled = tmp_path / "pickled"
    shutil.copytree(tiny_path, pickled)
    (pickled / "transformer" / "diffusion_pytorch_model.bin").write_bytes(b"\x80\x04")
    cases = (
        (TINY, str(pickled), "refusing pickle checkpoint files"),
        ("wan2.1-t2v-14b", tiny_path, "expects num_layers=40"),  # a real folder of another size
        (TINY, str(tmp_path / "missing"), "does not exist"),
    )
    for card, weights, words in cases:
        deploy = parse_deploy({"plugins": ["fv-wan"], "models": [{"card": card, "weights": weights}]})
        problems = check_deploy(deploy, wan_host)
        assert any(p.startswith("models[0].weights: ") and words in p for p in problems), problems
