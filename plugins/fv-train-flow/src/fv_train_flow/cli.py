"""``fv train CONFIG.yaml`` and ``fv eval``: parsers the core CLI mounts with ``add_*_parser(sub)``."""

from __future__ import annotations

import argparse
import json


def add_train_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("train", help="train with a registered method from a YAML config")
    p.add_argument("config", help="YAML config (see configs/shapes/)")
    p.add_argument("--steps", type=int, help="override the config's steps")
    p.add_argument("--output-dir", help="override the config's output_dir")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_train)
    return p


def cmd_train(args: argparse.Namespace) -> int:
    import torch

    from fv_core import load_plugins
    from fv_train_flow.config import load_config
    from fv_train_flow.trainer import train

    overrides = {k: v for k, v in {"steps": args.steps, "output_dir": args.output_dir}.items() if v}
    cfg = load_config(args.config, overrides)
    torch.set_num_threads(cfg.threads)
    factory = load_plugins().registries.methods.get(cfg.method)
    summary = train(cfg, factory(cfg), progress=not args.no_progress)
    print(json.dumps(summary, indent=2))
    return 0


def add_eval_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("eval", help="C4 quality of a shapes model: detector accuracy per attribute")
    p.add_argument("--model", default="wan2.1-t2v-shapes", help="card id (see `fv cards`)")
    p.add_argument("--weights", help="checkpoint folder (default: the card's embedded weights)")
    p.add_argument("--prompts", type=int, default=128, help="prompts per setting (fixed set)")
    p.add_argument("--steps", default="4,8,30", help="comma-separated step counts")
    p.add_argument("--guidance", default="1,4", help="comma-separated guidance scales")
    p.add_argument("--samplers", default="unipc", help="comma-separated samplers")
    p.add_argument("-o", "--output", help="write the report as JSON here")
    p.add_argument("--strip", help="write a PNG strip of sample videos (last setting) here")
    p.set_defaults(func=cmd_eval)
    return p


def cmd_eval(args: argparse.Namespace) -> int:
    from pathlib import Path

    from fv_train_flow.eval import evaluate_grid, load

    model = load(args.model, args.weights)
    report = evaluate_grid(
        model,
        args.prompts,
        [int(s) for s in args.steps.split(",")],
        [float(g) for g in args.guidance.split(",")],
        args.samplers.split(","),
        strip=Path(args.strip) if args.strip else None,
    )
    report = {"model": args.model, "weights": model.weights, **report}
    text = json.dumps(report, indent=2)
    if args.output:
        Path(args.output).write_text(text + "\n")
    print(text)
    return 0
