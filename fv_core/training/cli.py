"""``fv train CONFIG.yaml``: run a registered training method under the core trainer."""

from __future__ import annotations

import argparse
import json


def add_train_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("train", help="train with a registered method from a YAML config")
    p.add_argument("config", help="YAML config (see configs/)")
    p.add_argument("--steps", type=int, help="override the config's steps")
    p.add_argument("--output-dir", help="override the config's output_dir")
    p.add_argument("--device", help="override the config's device (cpu, cuda, cuda:1)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--describe", action="store_true", help="print the method's roles and consistency level, then exit"
    )
    p.set_defaults(func=cmd_train)
    return p


def cmd_train(args: argparse.Namespace) -> int:
    import torch

    from fv_core.plugins import load_plugins
    from fv_core.training.config import check_train_device, load_config
    from fv_core.training.trainer import train

    given = {"steps": args.steps, "output_dir": args.output_dir, "device": args.device}
    overrides = {k: v for k, v in given.items() if v}
    cfg = load_config(args.config, overrides)
    torch.set_num_threads(cfg.threads)
    factory = load_plugins().registries.methods.get(cfg.method)
    if args.describe:
        print(json.dumps({"method": cfg.method, **factory.spec.describe()}, indent=2))
        return 0
    check_train_device(cfg, factory.spec)  # before the method builds anything on it
    summary = train(cfg, factory(cfg), progress=not args.no_progress)
    print(json.dumps(summary, indent=2))
    return 0
