"""``fv generate``: run one task of a model and write its artifact and provenance.

Its request-param flags come from the cards' Params schemas: only ``--model``'s card's (grouped by task,
with the card's defaults) when ``--model`` names one, so plugins and cards are read only when a run or a
model's help needs them.
"""

from __future__ import annotations

import argparse
import sys
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fv_core.errors import ConfigError

if TYPE_CHECKING:
    from fv_core.deploy.card import DeploymentCard
    from fv_core.plugins import PluginHost

GENERIC_EPILOG = (
    "A model's request params (prompt, steps, size, ...) and their defaults: "
    "`fv generate --model CARD --help`; the installed cards: `fv cards`."
)


def add_generate_parser(sub: Any, argv: Sequence[str], load_host: Callable[[], PluginHost]) -> None:
    """``fv generate``; ``argv`` (the command's own arguments) decides which params get flags: none for a
    help without ``--model`` (no plugin is read), else ``--model``'s card's or every installed card's
    (the cards of ``load_host()``)."""
    gen = sub.add_parser(
        "generate",
        help="run one task of a model (a video by default) and write its artifact and provenance (JSON)",
        description="Request params not given take the card's defaults.",
        epilog=GENERIC_EPILOG,
    )
    _add_run_flags(gen)
    peek = argparse.ArgumentParser(add_help=False)
    peek.add_argument("--model")
    model = peek.parse_known_args(argv)[0].model
    if model is None and {"-h", "--help"} & set(argv):
        gen.set_defaults(func=cmd_generate, host=None, param_names=[])
        return
    host = load_host()
    gen.set_defaults(func=cmd_generate, host=host, param_names=add_param_flags(gen, host, model))


def _add_run_flags(gen: argparse.ArgumentParser) -> None:
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
        "--image",
        metavar="PATH",
        action="append",
        default=[],
        help="an input image (the first frame, for tasks that take one); repeat it for tasks that take "
        "several, in order (e.g. Qwen-Image-Edit Plus: Picture 1, 2, ...)",
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
        "--lora",
        metavar="PATH[:SCALE]",
        action="append",
        type=parse_lora,
        help="run with this LoRA (a .safetensors file or folder: diffusers', PEFT's or the family's own "
        "format) at SCALE (default 1); repeat it to combine LoRAs",
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
    from fv_core.workflow.run import LoadedWorkflow

    host = args.host
    raw = {name: getattr(args, name) for name in args.param_names}
    if args.size:
        raw["width"], raw["height"] = args.size
    name, weights, task, options = args.model, args.weights, args.task, None
    loras = []
    deploy = load_deploy(args.deploy) if args.deploy else None
    if args.replay:
        plan = replay_plan(host, args.replay)
        name, weights, deploy, task = plan.model, plan.weights, plan.deploy, task or plan.task
        raw, options = {**plan.params, **{k: v for k, v in raw.items() if v is not None}}, plan.plugin_options
        loras = [(a["path"], a["scale"], a.get("into")) for a in plan.adapters]  # the files it ran, again
    if name is None and weights is None and deploy is None:
        raise ConfigError(
            "nothing to load. Fix: pass --model CARD, --weights DIR|OWNER/NAME, --deploy FILE or --replay FILE."
        )
    if args.attention:
        check_provided(
            host.registries, "kernels", args.attention, f"--attention {args.attention}", "attention"
        )
        deploy = with_kernels(host, deploy, name, weights, {"attention": args.attention})
    if args.cache:
        deploy = with_cache(host, deploy, name, weights, *args.cache)
    if not sys.stderr.isatty():  # loaders' bars (downloads, transformers) redraw with carriage returns
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    model = load(name, weights, deploy=deploy, device=args.device, host=host, parallel=args.parallel)
    if isinstance(model, LoadedWorkflow):
        try:
            return _generate_workflow(args, model, raw)
        finally:
            model.close()
    try:
        adapters = add_adapters(model, [*loras, *((path, scale, None) for path, scale in args.lora or ())])
        return _generate(args, model, raw, task, options, adapters)
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


def parse_lora(text: str) -> tuple[str, float]:
    """``"style.safetensors:0.8"`` -> ("style.safetensors", 0.8); no ``:SCALE``: scale 1."""
    path, _, scale = text.rpartition(":") if ":" in text else (text, "", "1")
    try:
        return path, float(scale)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--lora {text!r}: SCALE {scale!r} is not a number. Fix: PATH or PATH:SCALE, e.g. style.safetensors:0.8"
        ) from None


def add_adapters(model: Any, loras: list[tuple[str, float, Any]]) -> list[tuple[str, float]]:
    """Serve each ``(path, scale, into)`` on ``model`` by its file's name; the request's adapters."""
    if loras and getattr(model.instance, "adapters", None) is None:
        raise ConfigError(
            f"--lora: {model.card.model_id!r} takes no LoRA adapters. Fix: drop --lora, or use a Wan or LTX-2 model."
        )
    names = []
    for i, (path, scale, into) in enumerate(loras):
        name = f"{Path(path).stem}-{i}"
        model.instance.adapters.add(name, path, into=into)
        names.append((name, scale))
    return names


def _generate_workflow(args: argparse.Namespace, flow: Any, raw: dict) -> int:
    """A deploy file's workflow: its params from the flags, its last stage's artifact written (with
    ``keep: all``, every stage's beside it as ``NAME.STAGE.EXT``) with the nested provenance."""
    from fv_core.progress import WorkflowProgress, files_line

    given = {k: v for k, v in raw.items() if v is not None}
    extra = sorted(set(given) - set(flow.spec.params))
    if extra:
        raise ConfigError(
            f"workflow {flow.workflow_id!r} takes the params {sorted(flow.spec.params)}; got {extra} too. "
            "Fix: drop them (stage params are set in the deploy file's workflow)."
        )
    shown = WorkflowProgress(flow.workflow_id)
    try:
        artifact = flow.generate(on_event=shown.event, **given)
    finally:
        shown.close()
    output = Path(args.output or DEFAULT_OUTPUT["video" if hasattr(artifact, "frames") else "image"])
    written = [artifact.save(output)]  # its provenance beside it
    written.append(written[0].with_suffix(".json"))
    for stage, kept in (getattr(artifact, "stages", None) or {}).items():
        written.append(
            kept.save(output.with_suffix(f".{stage}{output.suffix if hasattr(kept, 'frames') else '.png'}"))
        )
    print(files_line(written, artifact.provenance["seconds"]))
    return 0


def _generate(
    args: argparse.Namespace, model: Any, raw: dict, task: str | None, options: Any, adapters: list
) -> int:
    from fv_core.artifacts import SUFFIXES, AudioArtifact, ImageArtifact, write_provenance
    from fv_core.progress import RunProgress, files_line
    from fv_core.request.parts import image_part

    parts = [image_part(path) for path in args.image]
    if parts and task is None:  # an image picks the model's first task that takes one
        task = model.image_task()
    task, program = model.program(task)
    outputs = program.outputs
    output = Path(args.output or DEFAULT_OUTPUT[outputs[0]])
    if output.suffix.lower() not in SUFFIXES[outputs[0]]:
        raise ConfigError(
            f"-o {output}: a {outputs[0]} is saved as one of {', '.join(SUFFIXES[outputs[0]])}. Fix: rename it."
        )
    if args.audio_out and "audio" not in outputs:
        raise ConfigError(f"--audio-out: this task outputs {outputs}, no audio. Fix: drop --audio-out.")
    stream = _stream(args, model, task, raw, outputs, output)
    shown = RunProgress(f"{model.card.model_id} {task}", list(program.stages))

    def frames(partial: Any) -> None:  # a streaming loop's new frames ([F, H, W, 3] in 0..1)
        if stream is not None and isinstance(partial, dict) and "frames" in partial:
            stream.write(partial["frames"].float().cpu().numpy())
            shown.chunk(len(partial["frames"]), stream.frames, output)

    try:
        artifact = model.generate(
            task=task,
            parts=parts,
            plugin_options=options,
            on_event=shown.event,
            on_partial=frames,
            adapters=adapters,
            **raw,
        )
    finally:
        shown.close()
        if stream is not None:
            stream.close()
    if stream is not None and stream.frames:
        path = output  # the frames are in it already, written as they came
        write_provenance(path, artifact.provenance)
    else:
        if stream is not None:
            print(f"task {task!r} streams no frames: {output} is written whole")
        path = artifact.save(output)
    written = [path, path.with_suffix(".json")]
    if isinstance(artifact, ImageArtifact) and artifact.text is not None:  # its thinking, saved beside it
        written.append(path.with_suffix(".txt"))
    if args.audio_out:
        sound = artifact if isinstance(artifact, AudioArtifact) else getattr(artifact, "audio", None)
        assert sound is not None, "a task that outputs audio makes a sound track"
        written.append(sound.save(args.audio_out))
    print(files_line(written, artifact.provenance["seconds"]))
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


def add_param_flags(parser: argparse.ArgumentParser, host: PluginHost, model: str | None) -> list[str]:
    """One flag per request param: of ``model``'s tasks, grouped by task with the card's defaults, when
    ``model`` is a registered card; else of every installed card's tasks (``--weights``, ``--replay``)."""
    from fv_core.card.assemble import assemble_card

    if model is not None and model in host.registries.cards:
        card = assemble_card(host.registries, model)
        parser.epilog = f"The installed cards: `fv cards`; {model}'s schemas: `fv cards --json`."
        return _card_flags(parser, card)
    fields: dict[str, Any] = {}
    for model_id in sorted(str(k) for k in host.registries.cards):
        try:
            card = assemble_card(host.registries, model_id)
        except Exception:  # an invalid card is reported by `fv cards`; it adds no flags
            continue
        for task in card.programs:
            fields = {**_task_fields(card, task), **fields}
    group = parser.add_argument_group("request params (of every installed card; omitted: the card's default)")
    for name, (params, info, _) in fields.items():
        _add_flag(group, params, name, info, None)
    return list(fields)


def _card_flags(parser: argparse.ArgumentParser, card: Any) -> list[str]:
    """A group per task of ``card``: its params' flags with the defaults it runs with; a param an earlier
    task has already is listed by name with this task's default."""
    added: list[str] = []
    for task, program in card.programs.items():
        fields = _task_fields(card, task)
        shared = [n for n in fields if n in added]
        also = ", ".join(_flag(n) + _shown(fields[n][2], "") for n in shared)
        group = parser.add_argument_group(
            f"task {task} (outputs {', '.join(program.outputs)})", f"also takes {also}" if also else None
        )
        for name, (params, info, default) in fields.items():
            if name not in added:
                _add_flag(group, params, name, info, default)
                added.append(name)
    return added


_REQUIRED = object()


def _task_fields(card: Any, task: str) -> dict[str, tuple[Any, Any, Any]]:
    """``name -> (Params class, field info, the default task runs with)`` of ``task``'s params."""
    from fv_core.registry import resolve_lazy

    params = resolve_lazy(card.params_of(task))
    defaults = card.programs[task].defaults
    return {
        name: (params, info, defaults.get(name, _REQUIRED if info.is_required() else info.default))
        for name, info in params.model_fields.items()
    }


def _flag(name: str) -> str:
    return f"--{name.replace('_', '-')}"


def _shown(default: Any, description: str) -> str:
    """`` (default: X)``, `` (required)``, or nothing for None (it varies by card, or is unset) and for a
    description that states its default."""
    if default is None or "(default:" in description:
        return ""
    return " (required)" if default is _REQUIRED else f" (default: {default})"


def _add_flag(group: Any, params: Any, name: str, info: Any, default: Any) -> None:
    """``--name`` (and the field's ``cli`` aliases); a bool a ``--name`` / ``--no-name`` switch. ``default``
    (None: it varies by card) is shown in the help, unless the description states it."""
    from fv_core.request.params import field_extra

    # an alias another card's param already took (every installed card's flags at once) stays that one's
    taken = group._option_string_actions  # the parser's flags, shared by its groups
    flags = [_flag(name), *(f for f in field_extra(params, name, "cli", []) if f not in taken)]
    described = info.description or ""
    shown = _shown(default, described)
    kind, choices = _flag_type(info.annotation)
    if kind is bool:
        group.add_argument(
            *flags, dest=name, action=argparse.BooleanOptionalAction, default=None, help=described + shown
        )
        return
    group.add_argument(*flags, dest=name, type=kind, choices=choices, default=None, help=described + shown)


def _flag_type(annotation: Any) -> tuple[Any, list[Any] | None]:
    """argparse ``type`` and ``choices`` for a Params field annotation (Literal, bool, int, float, str)."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is typing.Literal:
        return type(args[0]), args
    if args:  # X | None
        return _flag_type(args[0])
    return (annotation if annotation in (bool, int, float) else str), None
