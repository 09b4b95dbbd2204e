"""``fv serve``'s arguments."""

from __future__ import annotations

import argparse

import torch

from fv_core.serving.cli import add_serve_parser, cmd_serve


def test_serve_parser_defaults_and_options(monkeypatch):
    monkeypatch.delenv("FV_API_KEY", raising=False)
    parser = argparse.ArgumentParser(prog="fv")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["serve", "deploy.yaml"])
    assert (args.deploy_file, args.host, args.port, args.api_key, args.func) == (
        "deploy.yaml",
        "127.0.0.1",
        8000,
        None,
        cmd_serve,
    )
    args = parser.parse_args(["serve", "d.yaml", "--host", "0.0.0.0", "--port", "9001", "--api-key", "k"])
    assert (args.host, args.port, args.api_key) == ("0.0.0.0", 9001, "k")


def test_serve_refuses_a_device_this_machine_lacks_before_starting(tmp_path, capsys):
    from fv_core.cli import main

    deploy = tmp_path / "d.yaml"
    deploy.write_text("plugins: [fv-wan]\nmodels:\n  - card: wan2.1-t2v-shapes\n")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for device in ("gpu0", f"cuda:{gpus}"):
        assert main(["serve", str(deploy), "--device", device, "--port", "1"]) == 2
        err = capsys.readouterr().err
        assert f"--device={device!r}" in err and "Fix:" in err


def test_serve_ray_without_a_fleet_plugin_names_the_flag_and_the_fix(tmp_path, monkeypatch, capsys):
    from fv_core.cli import main

    monkeypatch.setenv("FV_DISABLE_PLUGINS", "fv-ray-serve")
    deploy = tmp_path / "d.yaml"
    deploy.write_text("plugins: [fv-wan]\nmodels:\n  - card: wan2.1-t2v-shapes\n")
    assert main(["serve", "--ray", str(deploy)]) == 2
    err = capsys.readouterr().err
    assert "--ray" in err and "no installed plugin provides the 'ray' fleet" in err
    assert "Fix: install the plugin that provides it (--ray: pip install fv-ray-serve" in err
