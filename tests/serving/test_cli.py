"""``fv serve``'s arguments."""

from __future__ import annotations

import argparse

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
