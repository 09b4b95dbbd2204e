"""The design's falsifier: step-level scheduling vs request-level dispatch on one seeded Poisson trace.

Usage: python -m bench.trace_falsifier [--requests 24] [--loads 1.0 2.0] [--rounds 3] [--smoke]

Requests of mixed sizes and step counts arrive as a Poisson process. Both
policies serve the same trace on the same loaded model, in one process,
through AsyncEngine as ``fv serve`` drives it:

- step: ``determinism: batched`` — up to 16 requests running, their steps
  interleaved and compatible steps batched;
- request: the same engine admitting one request at a time (FIFO), i.e.
  dispatch of whole requests.

The arrival rate is ``load`` / (mean solo service time of the trace's
requests, measured in the warm-up): at 1.0 throughput is bound by arrivals and
latency is the question; at 2.0 the queue builds and throughput shows capacity. Reported per policy: throughput, p50 / p95 latency (arrival to
result), p50 / p95 time to first denoise step, requests in flight. Rounds
alternate the policy order. Writes bench/results/trace_falsifier.json + .png
(``--smoke``: the tiny checkpoint, 6 requests, no files unless --out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import fv_core
from fv_core.runtime import AsyncEngine, Budget, Engine

MEDIUM = dict(num_attention_heads=8, attention_head_dim=64, ffn_dim=2048, num_layers=8)  # wan_vs_diffusers
PROMPTS = ["a cat running in the forest", "a red car in the city at night", "a boat on the lake at sunset"]
POLICIES = {"step": 16, "request": 1}  # policy -> requests running at once
FULL = dict(shapes=[(5, 32, 32), (9, 48, 48), (9, 64, 64)], steps=[2, 4, 8])
SMOKE = dict(shapes=[(5, 32, 32), (5, 48, 48)], steps=[1, 2])


@dataclass(slots=True)
class Arrival:
    """One request of the trace."""

    at_s: float  # arrival offset, in units of the mean inter-arrival time until scaled
    frames: int  # num_frames
    size: int  # height = width
    steps: int  # num_inference_steps
    prompt: int  # index into PROMPTS
    seed: int  # request seed


def make_trace(n: int, seed: int, shapes: list[tuple[int, int, int]], steps: list[int]) -> list[Arrival]:
    """A seeded trace: unit-mean exponential gaps, shape and step count drawn uniformly."""
    rng, t, out = random.Random(seed), 0.0, []
    for i in range(n):
        frames, size, _ = rng.choice(shapes)
        out.append(Arrival(t, frames, size, rng.choice(steps), rng.randrange(len(PROMPTS)), 1000 + i))
        t += rng.expovariate(1.0)
    return out


class StepClock:
    """Observer (worker thread): when each request ran its first denoise step and finished its loop."""

    def __init__(self) -> None:
        self.first_step: dict[str, float] = {}
        self.finished: dict[str, float] = {}

    def on_start(self, state: Any, request: Any) -> None:
        return None

    def on_step(self, state: Any, plan: Any, result: Any) -> None:
        if plan.kind.value == "diffusion_step":
            self.first_step.setdefault(state.request_id, time.perf_counter())

    def on_finish(self, state: Any, result: Any) -> None:
        self.finished[state.request_id] = time.perf_counter()


def request_for(model: Any, a: Arrival, rid: str) -> Any:
    params = dict(
        prompt=PROMPTS[a.prompt],
        negative_prompt="blurry low quality",
        num_inference_steps=a.steps,
        guidance_scale=5.0,
        seed=a.seed,
        num_frames=a.frames,
        height=a.size,
        width=a.size,
    )
    return model.prepare(params, request_id=rid)


async def serve_trace(model: Any, trace: list[Arrival], gap_s: float, policy: str, tag: str) -> dict:
    """Serve the trace under one policy; per request: arrival, first step and finish times."""
    clock = StepClock()
    budget = Budget(max_running=POLICIES[policy], max_waiting=len(trace) + 1)
    engine = AsyncEngine(Engine(budget, observers=(clock,)), batching=True)
    done: dict[str, tuple[float, float]] = {}
    outputs: dict[str, torch.Tensor] = {}

    async def one(i: int, a: Arrival) -> None:
        await asyncio.sleep(max(0.0, t0 + a.at_s * gap_s - time.perf_counter()))
        rid, arrived = f"{tag}-{policy}-{i}", time.perf_counter()
        await engine.submit(*model.job(request_for(model, a, rid)))
        result = await engine.result(rid)
        done[rid] = (arrived, time.perf_counter())
        outputs[rid] = next(v for v in result.outputs.values() if isinstance(v, torch.Tensor))

    async with engine:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(i, a) for i, a in enumerate(trace)))
        wall = time.perf_counter() - t0
    return summarize(policy, trace, done, clock, wall) | {"outputs": outputs}


def pct(values: list[float], q: float) -> float:
    """The q-quantile (0..1), linear between order statistics."""
    s = sorted(values)
    k = (len(s) - 1) * q
    lo = int(k)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (k - lo)


def in_flight(spans: list[tuple[float, float]]) -> list[int]:
    """Requests in flight (arrived, not finished) just after each arrival."""
    return [sum(1 for a, f in spans if a <= at < f) for at, _ in spans]


def overlap(spans: list[tuple[float, float]]) -> int:
    """Most requests ever between their first denoise step and their loop's finish at once."""
    edges = sorted([(s, 1) for s, _ in spans] + [(f, -1) for _, f in spans])
    best = cur = 0
    for _, d in edges:
        cur += d
        best = max(best, cur)
    return best


def summarize(policy: str, trace: list[Arrival], done: dict, clock: StepClock, wall: float) -> dict[str, Any]:
    lat = [f - a for a, f in done.values()]
    ttfs = [clock.first_step[rid] - a for rid, (a, _) in done.items()]
    depth = in_flight(list(done.values()))
    return {
        "policy": policy,
        "max_running": POLICIES[policy],
        "requests": len(done),
        "wall_s": wall,
        "throughput_rps": len(done) / wall,
        "denoise_steps_per_s": sum(a.steps for a in trace) / wall,
        "latency_p50_s": pct(lat, 0.5),
        "latency_p95_s": pct(lat, 0.95),
        "latency_mean_s": statistics.fmean(lat),
        "ttfs_p50_s": pct(ttfs, 0.5),
        "ttfs_p95_s": pct(ttfs, 0.95),
        "in_flight_mean": statistics.fmean(depth),
        "in_flight_max": max(depth),
        "running_overlap_max": overlap([(clock.first_step[r], clock.finished[r]) for r in done]),
    }


def solo_seconds(model: Any, trace: list[Arrival]) -> float:
    """Warm every shape and prompt; return the trace's mean solo service time."""
    engine, cost = Engine(), {}
    for a in trace:
        key = (a.frames, a.size, a.steps)
        if key not in cost:
            engine.run_one(*model.job(request_for(model, a, f"warm-{len(cost)}")))  # warm-up
            t0 = time.perf_counter()
            engine.run_one(*model.job(request_for(model, a, f"solo-{len(cost)}")))
            cost[key] = time.perf_counter() - t0
    for p in range(len(PROMPTS)):
        engine.run_one(*model.job(request_for(model, Arrival(0.0, 5, 32, 1, p, 0), f"prompt-{p}")))
    return statistics.fmean(cost[(a.frames, a.size, a.steps)] for a in trace)


def run(
    weights: Path, requests: int, loads: list[float], rounds: int, seed: int, mix: dict, threads: int = 1
) -> dict[str, Any]:
    """Load the model, draw the trace, serve it at each load under both policies ``rounds`` times."""
    torch.set_num_threads(threads)
    model = fv_core.load(str(weights))
    trace = make_trace(requests, seed, mix["shapes"], mix["steps"])
    solo_s = solo_seconds(model, trace)
    return {
        "trace": {
            "requests": requests,
            "seed": seed,
            "mean_solo_service_s": solo_s,
            "shapes_frames_h_w": mix["shapes"],
            "steps": mix["steps"],
            "total_denoise_steps": sum(a.steps for a in trace),
        },
        "rounds": rounds,
        "torch_threads": threads,
        "loads": {f"{load:g}": serve_load(model, trace, solo_s / load, rounds) for load in loads},
    }


def serve_load(model: Any, trace: list[Arrival], gap_s: float, rounds: int) -> dict[str, Any]:
    """Both policies on the trace at one arrival rate, alternating which goes first."""
    runs: dict[str, list[dict]] = {p: [] for p in POLICIES}
    outputs: dict[str, dict[int, torch.Tensor]] = {p: {} for p in POLICIES}
    for r in range(rounds):
        order = list(POLICIES) if r % 2 == 0 else list(reversed(POLICIES))
        for policy in order:
            res = asyncio.run(serve_trace(model, trace, gap_s, policy, f"r{r}"))
            for rid, out in res.pop("outputs").items():
                outputs[policy][int(rid.rsplit("-", 1)[1])] = out
            runs[policy].append(res)
    worst = max((outputs["step"][i] - outputs["request"][i]).abs().max().item() for i in range(len(trace)))
    policies = {p: median_of(rs) | {"per_round": rs} for p, rs in runs.items()}
    return {
        "mean_interarrival_s": gap_s,
        "policies": policies,
        "step_over_request": compare(policies),
        "outputs_max_abs_diff_step_vs_request": worst,
    }


def compare(policies: dict[str, dict]) -> dict[str, float]:
    """Step-level over request-level, per headline metric (> 1: higher for step-level)."""
    keys = ("throughput_rps", "latency_p50_s", "latency_p95_s", "ttfs_p50_s", "ttfs_p95_s")
    return {k: policies["step"][k] / policies["request"][k] for k in keys}


def median_of(rounds: list[dict]) -> dict[str, Any]:
    """Per numeric metric: the median over rounds."""
    return {
        k: statistics.median([r[k] for r in rounds])
        for k, v in rounds[0].items()
        if isinstance(v, int | float)
    }


def smoke(folder: Path, requests: int = 6) -> dict[str, Any]:
    """The tiny checkpoint, a short trace, one round: the core of the bench, fast."""
    from fv_wan.tiny import write_tiny_checkpoint

    write_tiny_checkpoint(folder)
    return run(folder, requests, loads=[1.0], rounds=1, seed=0, mix=SMOKE)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = result["loads"]
    fig, axes = plt.subplots(len(loads), 2, figsize=(10, 4 * len(loads)), squeeze=False)
    for (left, right), (load, res) in zip(axes, loads.items(), strict=True):
        pols, names = res["policies"], list(res["policies"])
        for j, (metric, label) in enumerate(
            [
                ("latency_p50_s", "p50 latency"),
                ("latency_p95_s", "p95 latency"),
                ("ttfs_p50_s", "p50 first step"),
            ]
        ):
            xs = [i + 0.27 * j for i in range(len(names))]
            left.bar(xs, [pols[p][metric] for p in names], 0.27, label=label)
        left.set_xticks([i + 0.27 for i in range(len(names))], [f"{p}-level" for p in names])
        left.set_ylabel("seconds")
        left.legend(fontsize=8)
        left.set_title(f"load {load}: latency (median over rounds)")
        right.bar([f"{p}-level" for p in names], [pols[p]["throughput_rps"] for p in names])
        right.set_ylabel("requests / s")
        right.set_title(f"load {load}: throughput, {result['trace']['requests']} requests")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument(
        "--loads", type=float, nargs="+", default=[1.0, 2.0], help="arrival rate / solo service rate"
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--smoke", action="store_true", help="tiny checkpoint, 6 requests, one round")
    ap.add_argument("--out", help="JSON path (default bench/results/trace_falsifier.json; smoke: none)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.smoke:
            result = smoke(Path(tmp))
        else:
            from fv_wan.tiny import write_tiny_checkpoint

            write_tiny_checkpoint(Path(tmp), transformer=MEDIUM)
            result = run(Path(tmp), args.requests, args.loads, args.rounds, args.seed, FULL, args.threads)
    result = {"bench": "trace_falsifier", "model": "tiny" if args.smoke else {"transformer": MEDIUM}} | result
    out = args.out or (
        None if args.smoke else str(Path(__file__).parent / "results" / "trace_falsifier.json")
    )
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=2))
        plot(result, Path(out).with_suffix(".png"))
    print(json.dumps({k: v for k, v in result.items()}, indent=2))


if __name__ == "__main__":
    main()
