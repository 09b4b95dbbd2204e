"""``fv eval``: the parser the core CLI mounts with ``add_eval_parser(sub)`` (``fv train`` is the core's)."""

from __future__ import annotations

import argparse
import json


def add_eval_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("eval", help="C4 quality of a shapes model: detector accuracy per attribute")
    p.add_argument("--model", default="wan2.1-t2v-shapes", help="card id (see `fv cards`)")
    p.add_argument("--weights", help="checkpoint folder (default: the card's embedded weights)")
    p.add_argument("--device", default="cpu", help="torch device the model runs on (default: cpu)")
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

    model = load(args.model, args.weights, args.device)
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
