"""The ``fv`` command."""

from __future__ import annotations

import argparse
import json
import sys
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fv_core.errors import ConfigError, FvError
from fv_core.plugins import PluginHost, load_plugins
from fv_core.request.params import field_extra
from fv_core.request.parts import image_part

if TYPE_CHECKING:
    from fv_core.deploy.card import DeploymentCard


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


def parse_size(text: str) -> tuple[int, int]:
    """``"832x480"`` -> (width, height)."""
    try:
        width, height = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"size {text!r} is not WIDTHxHEIGHT, e.g. 832x480") from None
    return width, height


def cmd_generate(args: argparse.Namespace) -> int:
    from fv_core.deploy import load_deploy
    from fv_core.load import load
    from fv_core.providers import check_provided
    from fv_core.replay import replay_plan, with_kernels

    host = args.host
    raw = {name: getattr(args, name) for name in args.param_names}
    if args.size:
        raw["width"], raw["height"] = args.size
    name, weights, task, options = args.model, args.weights, args.task, None
    deploy = load_deploy(args.deploy) if args.deploy else None
    if args.replay:
        plan = replay_plan(host, args.replay)
        name, weights, deploy, task = plan.model, plan.weights, plan.deploy, task or plan.task
        raw, options = {**plan.params, **{k: v for k, v in raw.items() if v is not None}}, plan.plugin_options
    if name is None and weights is None and deploy is None:
        raise ConfigError(
            "nothing to load. Fix: pass --model CARD, --weights DIR|OWNER/NAME, --deploy FILE or --replay FILE."
        )
    if args.attention:
        check_provided(host.registries, "kernels", args.attention, f"--attention {args.attention}")
        deploy = with_kernels(host, deploy, name, weights, {"attention": args.attention})
    if args.cache:
        deploy = with_cache(host, deploy, name, weights, *args.cache)
    model = load(name, weights, deploy=deploy, device=args.device, host=host, parallel=args.parallel)
    try:
        return _generate(args, model, raw, task, options)
    finally:
        model.close()


def parse_cache(text: str) -> tuple[str, float | None]:
    """``"fbcache:0.1"`` -> ("fbcache", 0.1); ``"fbcache"`` -> ("fbcache", None)."""
    name, _, threshold = text.partition(":")
    if not threshold:
        return name, None
    try:
        return name, float(threshold)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: the threshold {threshold!r} is not a number; the form is NAME[:THRESHOLD], "
            "e.g. fbcache:0.1"
        ) from None


def with_cache(
    host: PluginHost,
    deploy: DeploymentCard | None,
    model: str | None,
    weights: str | None,
    interceptor: str,
    threshold: float | None,
) -> DeploymentCard:
    """``deploy`` (or a one-model deployment without caps) whose entry for ``model`` runs ``interceptor``,
    its plugin enabled and, with ``threshold``, that plugin's ``residual_diff_threshold`` set."""
    from fv_core.plugins import BUILTIN_PLUGIN
    from fv_core.providers import check_provided
    from fv_core.replay import one_model_deploy

    check_provided(host.registries, "interceptors", interceptor, f"--cache {interceptor}")
    if deploy is None:
        if model is None or model not in host.registries.cards:
            raise ConfigError(
                f"--cache {interceptor}: interceptors run on registered cards, and {model or weights!r} is not "
                "one. Fix: pass --model CARD (with --weights DIR)."
            )
        deploy = one_model_deploy(host, model, weights)
    deploy = deploy.model_copy(deep=True)
    entries = [m for m in deploy.models if model in (None, m.served_name)] or [
        m for m in deploy.models if m.card == model
    ]
    if len(entries) != 1:
        names = [m.served_name for m in deploy.models]
        raise ConfigError(f"--cache: choose one of the deployment's models {names}. Fix: pass --model NAME.")
    if interceptor not in entries[0].interceptors:
        entries[0].interceptors.append(interceptor)
    plugin = host.registries.interceptors.plugin_of(interceptor)
    deploy.plugins = sorted({*deploy.plugins, plugin} - {BUILTIN_PLUGIN})
    if threshold is not None:
        deploy.plugin_options[plugin] = {
            **deploy.plugin_options.get(plugin, {}),
            "residual_diff_threshold": threshold,
        }
    return deploy


def _generate(args: argparse.Namespace, model: Any, raw: dict, task: str | None, options: Any) -> int:
    from tqdm import tqdm

    from fv_core.artifacts import SUFFIXES, AudioArtifact, write_provenance

    parts = [image_part(args.image)] if args.image else []
    if parts and task is None:  # an image picks the model's first task that takes one
        task = model.image_task()
    outputs = model.card.programs[model.program(task)[0]].outputs
    output = Path(args.output or DEFAULT_OUTPUT[outputs[0]])
    if output.suffix.lower() not in SUFFIXES[outputs[0]]:
        raise ConfigError(
            f"-o {output}: a {outputs[0]} is saved as one of {', '.join(SUFFIXES[outputs[0]])}. Fix: rename it."
        )
    if args.audio_out and "audio" not in outputs:
        raise ConfigError(f"--audio-out: this task outputs {outputs}, no audio. Fix: drop --audio-out.")
    stream = _stream(args, model, task, raw, outputs, output)
    with tqdm(desc=model.card.model_id, unit="step", leave=False) as bar:

        def progress(step: int, total: int) -> None:
            bar.total = total
            bar.update(step - bar.n)

        def frames(partial: Any) -> None:  # a streaming loop's new frames ([F, H, W, 3] in 0..1)
            if stream is not None and isinstance(partial, dict) and "frames" in partial:
                stream.write(partial["frames"].float().cpu().numpy())

        try:
            artifact = model.generate(
                task=task, parts=parts, plugin_options=options, progress=progress, on_partial=frames, **raw
            )
        finally:
            if stream is not None:
                stream.close()
    if stream is not None and stream.frames:
        path = output  # the frames are in it already, written as they came
        write_provenance(path, artifact.provenance)
    else:
        if stream is not None:
            print(f"task {task or model.program(None)[0]!r} streams no frames: {output} is written whole")
        path = artifact.save(output)
    print(f"wrote {path} and {path.with_suffix('.json')} in {artifact.provenance['seconds']:.1f} s")
    if args.audio_out:
        sound = artifact if isinstance(artifact, AudioArtifact) else getattr(artifact, "audio", None)
        assert sound is not None, "a task that outputs audio makes a sound track"
        print(f"wrote {sound.save(args.audio_out)}")
    return 0


def _stream(
    args: argparse.Namespace, model: Any, task: str | None, raw: dict, outputs: list, output: Path
) -> Any:
    """``--stream``: the mp4 the frames are written into as they come (a video task without sound)."""
    from fv_core.artifacts import VideoStream

    if not args.stream:
        return None
    if outputs != ["video"] or output.suffix.lower() != ".mp4":
        raise ConfigError(
            f"--stream writes an .mp4 of a video task without sound; this task outputs {outputs} into "
            f"{output.name}. Fix: drop --stream, or stream a video task (e.g. a causal card) into an .mp4."
        )
    fps = raw.get("fps") or model.card.programs[model.program(task)[0]].defaults.get("fps", 16)
    return VideoStream(output, int(fps))


DEFAULT_OUTPUT = {"video": "out.mp4", "image": "out.png", "audio": "out.wav", "text": "out.txt"}


def add_param_flags(parser: argparse.ArgumentParser, host: PluginHost) -> list[str]:
    """One flag per request param of every installed card's tasks (from their Params schemas)."""
    from fv_core.card.assemble import assemble_card
    from fv_core.registry import resolve_lazy

    fields: dict[str, Any] = {}
    for model_id in sorted(str(k) for k in host.registries.cards):
        try:
            card = assemble_card(host.registries, model_id)
        except Exception:  # an invalid card is reported by `fv cards`; it adds no flags
            continue
        for task in card.programs:
            params = resolve_lazy(card.params_of(task))
            for name, info in params.model_fields.items():
                fields.setdefault(name, (params, info))
    for name, (params, info) in fields.items():
        flags = [f"--{name.replace('_', '-')}", *field_extra(params, name, "cli", [])]
        kind, choices = _flag_type(info.annotation)
        parser.add_argument(
            *flags,
            dest=name,
            type=kind,
            choices=choices,
            default=None,
            help=f"{info.description} (default: the card's)",
        )
    return list(fields)


def _flag_type(annotation: Any) -> tuple[Any, list[Any] | None]:
    """argparse ``type`` and ``choices`` for a Params field annotation (Literal, int, float, str)."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is typing.Literal:
        return type(args[0]), args
    if args:  # X | None
        return _flag_type(args[0])
    return (annotation if annotation in (int, float) else str), None


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
    host = load_plugins()
    gen = sub.add_parser(
        "generate",
        help="run one task of a model (a video by default) and write its artifact and provenance (JSON)",
        description="Request params below come from the installed cards' schemas (`fv cards --json`); "
        "omitted ones take the card's defaults.",
    )
    gen.add_argument(
        "--model", help="card id (see `fv cards`), a diffusers-format folder or a Hugging Face repo id"
    )
    gen.add_argument(
        "--weights",
        metavar="DIR|OWNER/NAME[@REV]",
        help="checkpoint folder or Hugging Face repo id, read from the local cache or downloaded "
        "(default: the card's embedded weights, else its published repo); alone, the card is built "
        "from the checkpoint's configs",
    )
    gen.add_argument("--task", help="the card's task, e.g. t2v or t2i (default: the card's first)")
    gen.add_argument(
        "--device", default="cpu", help="torch device the model runs on, e.g. cuda (default: cpu)"
    )
    gen.add_argument("--deploy", metavar="FILE", help="run the model as this deploy file's entry for it")
    gen.add_argument("--replay", metavar="JSON", help="re-run the request recorded in a provenance file")
    gen.add_argument("--size", type=parse_size, help="WIDTHxHEIGHT (sets --width and --height)")
    gen.add_argument(
        "--image", metavar="PATH", help="an input image (the first frame, for tasks that take one)"
    )
    gen.add_argument(
        "--attention",
        metavar="VARIANT",
        help="attention kernel variant, e.g. sta (default: the card's; see `fv cards`)",
    )
    gen.add_argument(
        "--cache",
        metavar="NAME[:THRESHOLD]",
        type=parse_cache,
        help="enable a cache interceptor for this run: fbcache, dbcache or taylorseer (fv-cache-dit), "
        "THRESHOLD its residual_diff_threshold, e.g. fbcache:0.1 (other options: a deploy file's plugin_options)",
    )
    gen.add_argument(
        "--parallel",
        metavar="PLAN",
        help="run on a group of processes, e.g. sp=2,cfg=2 (sequence-parallel x CFG-parallel; "
        "default: the deploy entry's, else one process)",
    )
    gen.add_argument("-o", "--output", help="output file (default: out.mp4, out.png, ... by the task)")
    gen.add_argument(
        "--audio-out", metavar="WAV", help="also write the soundtrack as a .wav (tasks with audio)"
    )
    gen.add_argument(
        "--stream",
        action="store_true",
        help="write the mp4's frames as the model makes them (a causal card streams chunk by chunk; "
        "the file is fragmented, so players read it while it grows)",
    )
    gen.set_defaults(func=cmd_generate, host=host, param_names=add_param_flags(gen, host))
    from fv_core.serving.cli import add_serve_parser  # imports FastAPI only when installed with [serve]

    add_serve_parser(sub)
    from fv_core.training.cli import add_train_parser

    add_train_parser(sub)
    from fv_core.chat_cli import add_chat_parser

    add_chat_parser(sub)
    commands = host.registries.commands
    for name in sorted(str(k) for k in commands):
        commands.get(name)(sub)  # plugin subcommands, e.g. `fv eval` from fv-train-flow
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
