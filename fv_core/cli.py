"""The ``fv`` command."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from fv_core.errors import FvError
from fv_core.plugins import load_plugins


def cmd_plugins(args: argparse.Namespace) -> int:
    print(json.dumps(load_plugins().report(), indent=2, default=str))
    return 0


def cmd_cards(args: argparse.Namespace) -> int:
    from fv_core.card.assemble import describe_card

    host = load_plugins()
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fv", description="fv: a model-native runtime for diffusion models")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("plugins", help="list discovered plugins as JSON").set_defaults(func=cmd_plugins)
    cards = sub.add_parser("cards", help="list assembled model cards")
    cards.add_argument("--json", action="store_true", help="print JSON")
    cards.set_defaults(func=cmd_cards)
    validate = sub.add_parser("validate", help="validate a deploy file against what is installed")
    validate.add_argument("deploy_file")
    validate.set_defaults(func=cmd_validate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except FvError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
