"""``fv train CONFIG.yaml``: run a registered training method under the core trainer.

Ctrl-C or SIGTERM saves a checkpoint at the next step boundary and prints the command that resumes
it (``fv train CONFIG --resume DIR``); a second one stops at once, keeping the earlier checkpoints."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path


def add_train_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("train", help="train with a registered method from a YAML config")
    p.add_argument("config", help="YAML config (see configs/)")
    p.add_argument("--steps", type=int, help="override the config's steps")
    p.add_argument("--output-dir", help="override the config's output_dir")
    p.add_argument("--device", help="override the config's device (cpu, cuda, cuda:1)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--resume",
        nargs="?",
        const="",
        metavar="DIR",
        help="continue the run in DIR (default: the config's output_dir) from its newest checkpoint; "
        "an error if there is none (re-running a config also resumes, but starts fresh when there is none)",
    )
    p.add_argument(
        "--describe", action="store_true", help="print the method's roles and consistency level, then exit"
    )
    p.set_defaults(func=cmd_train)
    return p


def cmd_train(args: argparse.Namespace) -> int:
    import torch

    from fv_core.errors import ConfigError
    from fv_core.plugins import load_plugins
    from fv_core.training.config import check_train_device, load_config
    from fv_core.training.stop import StopRequest, TrainingStopped
    from fv_core.training.trainer import check_resumable, checkpoints, train

    if args.resume and args.output_dir and Path(args.resume) != Path(args.output_dir):
        raise ConfigError(
            f"--resume {args.resume} with --output-dir {args.output_dir}: a run resumes in its own folder. "
            "Fix: pass the folder once, as --resume DIR"
        )
    given = {"steps": args.steps, "output_dir": args.resume or args.output_dir, "device": args.device}
    overrides = {k: v for k, v in given.items() if v}
    cfg = load_config(args.config, overrides)
    if args.resume is not None:
        ckpts = checkpoints(cfg.output_dir)
        if not ckpts:
            raise ConfigError(
                f"--resume: {str(cfg.output_dir)!r} holds no checkpoint-<step>/ folder (a run writes one "
                f"every checkpoint_every={cfg.checkpoint_every} steps, at its end and when stopped by "
                "Ctrl-C). Fix: pass the output folder of the run to continue, or drop --resume to start one"
            )
        check_resumable(cfg, ckpts[-1])  # before the method builds anything
    torch.set_num_threads(cfg.threads)
    factory = load_plugins().registries.methods.get(cfg.method)
    if args.describe:
        print(json.dumps({"method": cfg.method, **factory.spec.describe()}, indent=2))
        return 0
    check_train_device(cfg, factory.spec)  # before the method builds anything on it
    resume = _resume_command(args, str(cfg.output_dir))
    try:
        with StopRequest() as stop:
            summary = train(cfg, factory(cfg), progress=not args.no_progress, stop=stop)
    except TrainingStopped as stopped:
        print(f"{stopped}. Resume: {resume}", file=sys.stderr)
        return stopped.exit_code
    except KeyboardInterrupt:
        ckpts = checkpoints(cfg.output_dir)
        if ckpts:
            print(f"stopped without saving; newest checkpoint {ckpts[-1]}. Resume: {resume}", file=sys.stderr)
        else:
            print(f"stopped before any checkpoint; to start again: fv train {args.config}", file=sys.stderr)
        return 130
    print(json.dumps(summary, indent=2))
    return 0


def _resume_command(args: argparse.Namespace, output_dir: str) -> str:
    """The ``fv train`` command that continues this run: its config and overrides, ``--resume DIR``."""
    argv = ["fv", "train", args.config]
    argv += ["--steps", str(args.steps)] if args.steps else []
    argv += ["--device", args.device] if args.device else []
    argv += ["--no-progress"] if args.no_progress else []
    return shlex.join([*argv, "--resume", output_dir])
