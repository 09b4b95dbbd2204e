"""Workflows: 8 concurrent ``t2i-to-i2v`` workflows on medium random-weight Wan (CPU) against the same
stages run one after another by hand, and the workflow layer's own cost.

Usage: python bench/workflows.py [--steps 4] [--repeats 3] [--threads 1] [--smoke] [--out PATH]

One process, round by round:
- ``workflows_concurrent``: 8 workflows run at once on one async engine (the server's: ``arun``), so
  each stage's requests batch with the other workflows' at the same stage;
- ``by_hand_serial``: for each request a Wan2.1 T2V still (``generate(task="t2i")``), then Wan2.1 I2V
  on it (``generate(task="i2v", image=...)``), one after another;
- ``workflow_one`` / ``by_hand_one``: one workflow vs its two stages by hand: the workflow layer's
  overhead per stage is their difference over two stages, relative to the stages' time.
JSON + PNG. ``--smoke``: tiny checkpoints, 2 steps, one round.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from cache_dit_vs_package import MEDIUM  # noqa: E402

REQUESTS = 8
SIZE = dict(num_frames=5, height=64, width=64)


def deploy_of(t2v: Path, i2v: Path, steps: int) -> dict:
    fixed = {"num_inference_steps": steps, "guidance_scale": 5.0, **SIZE}
    still = {
        "num_inference_steps": steps,
        "guidance_scale": 5.0,
        "height": SIZE["height"],
        "width": SIZE["width"],
    }
    return {
        "plugins": ["fv-wan"],
        "models": [{"card": str(t2v), "name": "t2v"}, {"card": str(i2v), "name": "i2v"}],
        "limits": {"max_running": 64, "max_queue": 64},
        "workflows": {
            "t2i-to-i2v": {
                "params": {"prompt": None, "seed": 0},
                "stages": [
                    {"name": "still", "model": "t2v", "task": "t2i", "params": still,
                     "bind": {"prompt": "request.prompt", "seed": "request.seed"}},
                    {"name": "motion", "model": "i2v", "task": "i2v", "params": fixed,
                     "bind": {"image": "still.image", "prompt": "request.prompt", "seed": "request.seed"}},
                ],
            }
        },
    }  # fmt: skip


def by_hand(flow, prompt: str, seed: int):
    spec = flow.spec.stages
    still = flow.models["t2v"].generate(task="t2i", prompt=prompt, seed=seed, **spec[0].params)
    return flow.models["i2v"].generate(
        task="i2v", image=still.image, prompt=prompt, seed=seed, **spec[1].params
    )


def concurrent(flow, n: int) -> list:
    from fv_core.runtime import AsyncEngine, Budget, Engine

    async def run() -> list:
        engine = AsyncEngine(Engine(Budget(max_running=64, max_waiting=64)))
        await engine.start()

        async def execute(stage) -> list:  # a StageRun: one stage's requests on its model
            loaded = flow.models[stage.model]
            rids = [await engine.submit(*loaded.job(r)) for r in stage.requests]
            return [await engine.result(rid) for rid in rids]

        try:
            params = [flow.prepare({"prompt": f"a lantern {i}", "seed": i}) for i in range(n)]
            return list(await asyncio.gather(*(flow.arun(p, execute) for p in params)))
        finally:
            await engine.stop()

    return asyncio.run(run())


def timed(fn, repeats: int) -> tuple[list[float], object]:
    out, times = None, []
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return times, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", help="JSON path (default bench/results/workflows.json; --smoke: the temp dir)")
    args = ap.parse_args()
    import numpy as np
    import torch

    import fv_core
    from fv_core.deploy.card import parse_deploy
    from fv_wan.tiny import write_tiny_checkpoint

    torch.set_num_threads(args.threads)
    steps, repeats = (2, 1) if args.smoke else (args.steps, args.repeats)
    with tempfile.TemporaryDirectory() as tmp:
        shape = None if args.smoke else MEDIUM
        write_tiny_checkpoint(Path(tmp) / "t2v", transformer=shape)
        i2v_shape = (
            None if shape is None else {**shape, "added_kv_proj_dim": 8 * 64}
        )  # image K/V at the width
        write_tiny_checkpoint(Path(tmp) / "i2v", transformer=i2v_shape, variant="i2v")
        deploy = parse_deploy(deploy_of(Path(tmp) / "t2v", Path(tmp) / "i2v", steps))
        flow = fv_core.load("t2i-to-i2v", deploy=deploy)
        with torch.inference_mode():
            by_hand(flow, "warm-up", 0)  # components, caches
            runs = {
                "workflows_concurrent": lambda: concurrent(flow, REQUESTS),
                "by_hand_serial": lambda: [by_hand(flow, f"a lantern {i}", i) for i in range(REQUESTS)],
                "workflow_one": lambda: flow.generate(prompt="a lantern 0", seed=0),
                "by_hand_one": lambda: by_hand(flow, "a lantern 0", 0),
            }
            times, outs = {}, {}
            for _ in range(repeats):  # rounds alternate the runs (the machine is shared and noisy)
                for name, fn in runs.items():
                    seconds, outs[name] = timed(fn, 1)
                    times.setdefault(name, []).extend(seconds)
    wall = {k: {"min": min(v), "median": statistics.median(v)} for k, v in times.items()}
    one, hand = wall["workflow_one"]["min"], wall["by_hand_one"]["min"]
    result = {
        "checkpoint": {"transformer": "tiny" if args.smoke else MEDIUM, "weights": "random"},
        "request": {**SIZE, "steps": steps, "workflows": REQUESTS},
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "torch_threads": args.threads,
            "repeats": repeats,
            "load_avg_1m": os.getloadavg()[0],
            "smoke": args.smoke,
        },
        "wall_s": wall,
        "concurrent_vs_by_hand_serial": wall["by_hand_serial"]["min"] / wall["workflows_concurrent"]["min"],
        "layer_overhead_per_stage": (one - hand) / 2 / (hand / 2),
        "workflow_equals_by_hand": bool(
            np.array_equal(outs["workflow_one"].frames, outs["by_hand_one"].frames)
        ),
        "goal": "workflow layer overhead <= 1% of stage time",
        "note": "layer_overhead_per_stage = (one workflow - its stages by hand) / 2 stages, over a stage's time "
        "(min over rounds; negative: within the noise)",
    }
    out = Path(
        args.out
        or Path(tempfile.gettempdir() if args.smoke else Path(__file__).parent / "results") / "workflows.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    plot(out.with_suffix(".png"), wall)
    print(
        json.dumps(
            {k: result[k] for k in ("wall_s", "concurrent_vs_by_hand_serial", "layer_overhead_per_stage")},
            indent=1,
        )
    )


def plot(path: Path, wall: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    names = list(wall)
    ax.bar(names, [wall[n]["min"] for n in names], color=["tab:blue", "grey", "tab:cyan", "lightgrey"])
    ax.set_ylabel("seconds (min over rounds)")
    ax.set_title(f"{REQUESTS} t2i-to-i2v workflows: concurrent vs by hand; one vs its stages")
    ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
