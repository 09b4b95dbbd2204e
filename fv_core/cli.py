"""The ``fv`` command."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from fv_core.errors import ConfigError, FvError, UnknownKeyError
from fv_core.plugins import PluginHost, load_plugins


def cmd_plugins(args: argparse.Namespace) -> int:
    print(json.dumps(load_plugins().report(), indent=2, default=str))
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
    from fv_core.model import resolve_kernels

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


def parse_size(text: str) -> tuple[int, int]:
    """``"832x480"`` -> (width, height)."""
    try:
        width, height = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"size {text!r} is not WIDTHxHEIGHT, e.g. 832x480") from None
    return width, height


def cmd_generate(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from fv_core.generate import generate_video
    from fv_core.model import load_model, resolve_kernels

    host = load_plugins()
    if args.model not in host.registries.cards:
        available = sorted(str(k) for k in host.registries.cards)
        raise UnknownKeyError(
            f"unknown model {args.model!r}. Available: {available}. Fix: pick one (see `fv cards`)."
        )
    card = host.card(args.model)
    width, height = args.size if args.size else (None, None)
    params = {
        "prompt": args.prompt,
        "negative_prompt": args.negative_prompt,
        "num_frames": args.frames,
        "height": height,
        "width": width,
        "steps": args.steps,
        "guidance": args.guidance,
        "sampler": args.sampler,
        "cfg_mode": args.cfg_mode,
    }
    params = {k: v for k, v in params.items() if v is not None}
    kernels = resolve_kernels(host, card, requested={"attention": args.attention} if args.attention else None)
    model = load_model(
        card, args.weights, plugin=host.registries.cards.plugin_of(args.model), kernels=kernels
    )
    with tqdm(desc=f"{card.model_id}", unit="step", leave=False) as bar:

        def progress(step: int, total: int) -> None:
            bar.total = total
            bar.update(step - bar.n)

        video = generate_video(model, params, seed=args.seed, progress=progress)
    path = video.save(args.output)
    print(
        f"wrote {path} ({video.frames.shape[0]} frames, {video.frames.shape[2]}x{video.frames.shape[1]}) "
        f"and {path.with_suffix('.json')} in {video.provenance['seconds']:.1f} s"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fv", description="fv: a model-native runtime for diffusion models")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("plugins", help="list discovered plugins as JSON").set_defaults(func=cmd_plugins)
    cards = sub.add_parser("cards", help="list assembled model cards")
    cards.add_argument("--json", action="store_true", help="print JSON")
    cards.add_argument("--deploy", metavar="FILE", help="show the kernels this deploy file selects per model")
    cards.add_argument("--device", default="cpu", help="device the --deploy selection is for (default: cpu)")
    cards.set_defaults(func=cmd_cards)
    validate = sub.add_parser("validate", help="validate a deploy file against what is installed")
    validate.add_argument("deploy_file")
    validate.set_defaults(func=cmd_validate)
    gen = sub.add_parser("generate", help="generate a video (mp4) and its provenance (JSON)")
    gen.add_argument("--model", required=True, help="card id, e.g. wan2.1-t2v-tiny (see `fv cards`)")
    gen.add_argument("--weights", help="checkpoint folder (default: the card's embedded weights)")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--negative-prompt")
    gen.add_argument("--frames", type=int, help="number of frames (4k+1 for Wan)")
    gen.add_argument("--size", type=parse_size, help="WIDTHxHEIGHT, multiples of 16")
    gen.add_argument("--steps", type=int, help="denoising steps")
    gen.add_argument("--guidance", type=float, help="classifier-free guidance scale")
    gen.add_argument("--sampler", help="sampler name (the card lists them)")
    gen.add_argument(
        "--cfg-mode", choices=["two_forward", "batched"], help="CFG as two forwards or one batched"
    )
    gen.add_argument(
        "--attention",
        metavar="VARIANT",
        help="attention kernel variant, e.g. sta (default: the card's; see `fv cards`)",
    )
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("-o", "--output", default="out.mp4", help="output .mp4 (or .png for one frame)")
    gen.set_defaults(func=cmd_generate)
    from fv_core.serving.cli import add_serve_parser  # imports FastAPI only when installed with [serve]

    add_serve_parser(sub)
    commands = load_plugins().registries.commands
    for name in sorted(str(k) for k in commands):
        commands.get(name)(sub)  # plugin subcommands, e.g. `fv train` from fv-train-flow
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
