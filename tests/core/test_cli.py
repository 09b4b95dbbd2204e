import json

import pytest

from fv_core.cli import main


@pytest.fixture
def example_env(on_path, monkeypatch):
    monkeypatch.setenv(
        "FV_PLUGINS", "fv-wan,fv-example,fv-broken"
    )  # the example's card derives from fv-wan's


def test_plugins_json(example_env, capsys):
    assert main(["plugins"]) == 0
    report = {p["name"]: p for p in json.loads(capsys.readouterr().out)}
    assert set(report) == {"fv-core", "fv-wan", "fv-example", "fv-broken"}
    assert report["fv-example"]["hooks"] == [
        "fv_register_cards",
        "fv_register_interceptors",
        "fv_register_kernels",
        "fv_register_options",
    ]
    assert report["fv-example"]["registered"]["kernels"] == ["('attention', 'cpu', 'any', 'naive')"]
    assert "RuntimeError: boom" in report["fv-broken"]["error"]


def test_cards_text_and_json(example_env, capsys):
    assert main(["cards"]) == 0
    text = capsys.readouterr().out
    assert "shapes-euler-8  (wan, from fv-example)" in text
    assert "interceptors available: step-counter" in text
    assert main(["cards", "--json"]) == 0
    card = {c["model_id"]: c for c in json.loads(capsys.readouterr().out)}["shapes-euler-8"]
    assert (
        card["kernels_available"]
        == {"attention": ["naive", "sdpa"], "packed_attention": ["flex", "padded", "sdpa", "segments"]}
        and card["parent"] == "wan2.1-t2v-shapes"
    )
    steps = card["tasks"]["t2v"]["params"]["properties"]["num_inference_steps"]
    assert steps["default"] == 8 and steps["minimum"] == 1


def test_validate_exit_codes(example_env, tmp_path, capsys):
    good = tmp_path / "good.yaml"
    good.write_text("plugins: [fv-wan, fv-example]\nmodels:\n  - card: shapes-euler-8\n")
    assert main(["validate", str(good)]) == 0
    assert "ok:" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text("plugins: [fv-example, fv-broken]\nmodels:\n  - card: nope\n")
    assert main(["validate", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "fv-broken" in err and "unknown cards key 'nope'" in err
    typo = tmp_path / "typo.yaml"
    typo.write_text("modelz: []\n")
    assert main(["validate", str(typo)]) == 1
    assert "modelz: Extra inputs are not permitted" in capsys.readouterr().err
