"""The ``fv`` command."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from fv_core.chat_cli import add_chat_parser
from fv_core.errors import ConfigError, FvError
from fv_core.generate_cli import add_generate_parser
from fv_core.plugins import load_plugins
from fv_core.serving.cli import add_serve_parser

if TYPE_CHECKING:
    from fv_core.plugins import PluginHost


def cmd_plugins(args: argparse.Namespace) -> int:
    print(json.dumps(load_plugins().report(imports=args.imports), indent=2, default=str))
    return 0


def cmd_cards(args: argparse.Namespace) -> int:
    from fv_core.card.assemble import describe_card

    host = load_plugins()
    if args.deploy:
        return _deploy_kernels(host, args.deploy, args.device, args.json)
    cards = [describe_card(host.registries, str(k)) for k in sorted(host.registries.cards, key=str)]
    if args.json:
        print(json.dumps(cards, indent=2, default=str))
        return 0
    if not cards:
        print("no cards registered. Install a model plugin, e.g. `pip install fv-wan`.")
    for c in cards:
        if "error" in c:
            print(f"{c['model_id']}  [INVALID, from {c['registered_by']}]  {c['error']}")
            continue
        print(f"{c['model_id']}  ({c['family']}, from {c['registered_by']})")
        print(f"  {c['description']}")
        print(
            f"  tasks: {', '.join(c['tasks'])}   loops: {', '.join(c['loops'])}   "
            f"recipe: {c['recipe']['method']} assumes {c['recipe']['assumes_loop']!r}"
        )
        print(f"  kernels: {c['kernels']}   available: {c['kernels_available']}")
        print(f"  interceptors available: {', '.join(c['interceptors_available']) or 'none'}")
    return 0


def _deploy_kernels(host: PluginHost, path: str, device: str, as_json: bool) -> int:
    """The kernels each model of the deploy file at ``path`` runs on ``device``."""
    from fv_core.deploy import check_deploy, deploy_plugin_options, load_deploy
    from fv_core.load import resolve_kernels

    deploy = load_deploy(path)
    problems = check_deploy(deploy, host, device)
    if problems:
        raise ConfigError(f"{path} is invalid:\n" + "\n".join(f"  - {p}" for p in problems))
    options = deploy_plugin_options(host, deploy)
    selected = {
        m.served_name: {
            op: record
            for op, (_, record) in resolve_kernels(
                host, host.card(m.card), device, options, m.kernels
            ).items()
        }
        for m in deploy.models
    }
    if as_json:
        print(json.dumps(selected, indent=2))
        return 0
    for name, kernels in selected.items():
        print(f"{name}  (deploy {path}, device {device})")
        for op, r in kernels.items():
            fallback = f"   fallback: {r['fallback_reason']}" if r["fallback_reason"] else ""
            print(f"  {op}: {r['variant']} from {r['plugin']}, key {tuple(r['key'])}{fallback}")
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from fv_core.deploy import check_deploy, load_deploy

    try:
        deploy = load_deploy(args.deploy_file)
    except FvError as exc:
        print(f"invalid: {exc}", file=sys.stderr)
        return 1
    problems = check_deploy(deploy, load_plugins())
    if problems:
        print(f"invalid: {args.deploy_file}", file=sys.stderr)
        for p in problems:
            print(f"  - {p}", file=sys.stderr)
        return 1
    print(f"ok: {args.deploy_file}: {len(deploy.models)} model(s), plugins {deploy.plugins}")
    return 0


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The core's commands; plugins are read only by the commands that use them, and by ``argv`` naming a
    command the core lacks (a plugin's, e.g. ``fv eval`` from fv-train-flow)."""
    parser = argparse.ArgumentParser(
        prog="fv",
        description="fv: a model-native runtime for diffusion models",
        epilog="Plugins add commands (e.g. `fv eval` from fv-train-flow): `fv plugins` lists what each registers.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    plugins = sub.add_parser("plugins", help="list discovered plugins as JSON")
    plugins.add_argument(
        "--imports",
        action="store_true",
        help="import every lazy registration (torch, Ray, ...), so a broken import is reported too "
        "(default: only a missing module is)",
    )
    plugins.set_defaults(func=cmd_plugins)
    cards = sub.add_parser("cards", help="list assembled model cards")
    cards.add_argument("--json", action="store_true", help="print JSON")
    cards.add_argument("--deploy", metavar="FILE", help="show the kernels this deploy file selects per model")
    cards.add_argument("--device", default="cpu", help="device the --deploy selection is for (default: cpu)")
    cards.set_defaults(func=cmd_cards)
    validate = sub.add_parser("validate", help="validate a deploy file against what is installed")
    validate.add_argument("deploy_file")
    validate.set_defaults(func=cmd_validate)
    command = next((a for a in argv if not a.startswith("-")), None)
    add_generate_parser(
        sub, argv[argv.index(command) + 1 :] if command == "generate" else ["--help"], load_plugins
    )
    add_serve_parser(sub)  # imports FastAPI only when `fv serve` runs
    if command == "train":  # fv_core.training imports torch: its parser is built for `fv train` only
        from fv_core.training.cli import add_train_parser

        add_train_parser(sub)
    else:
        sub.add_parser("train", help="train with a registered method from a YAML config")
    add_chat_parser(sub)
    if command is not None and command not in sub.choices:
        commands = load_plugins().registries.commands
        for name in sorted(str(k) for k in commands):
            commands.get(name)(sub)  # plugin subcommands, e.g. `fv eval` from fv-train-flow
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    try:
        return int(args.func(args))
    except FvError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
