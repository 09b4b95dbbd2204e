"""The design's falsifier: scheduling policies on one seeded Poisson trace, per regime and load.

Usage: python -m bench.trace_falsifier [--requests 24] [--loads 0.5 1 2 3] [--rounds 3]
       [--regimes medium tiny] [--smoke]

Requests of mixed sizes and step counts arrive as a Poisson process. Each
policy serves the same trace on the same loaded model, in one process,
through AsyncEngine as ``fv serve`` drives it (``determinism: batched``, up to
16 requests admitted), with a fresh engine and cost model per run (it learns
its batch curve online, as a restarted server does):

- fifo: request-level FIFO, one request's steps at a time (dispatch of whole requests);
- fair: step-level time-sharing, every running request a step per tick, compatible steps batched;
- auto: the cost model decides: batch where the measured batch curve pays, else the least
  remaining work first, with an aging bound (fv_core/runtime/policy.py).

Regimes: ``medium`` (a medium Wan transformer, 3 sizes x 2/4/8 steps: a batched
call costs about its rows apart on a CPU) and ``tiny`` (the tiny checkpoint at
small sizes and 1-2 steps, few-step-student-like, where a batched call costs
about one row: batching pays). The arrival rate is ``load`` / (mean solo service
time of the trace's requests, measured in the warm-up): below 1 latency is the
question, above 1 the queue builds and throughput shows capacity. Reported per
policy: throughput, p50 / p95 latency (arrival to result), p50 / p95 time to
first denoise step, requests in flight, the scheduler's decisions and the cost
model's median |measured / predicted - 1| per call; per load, ``auto`` over the
better of fifo and fair. Rounds alternate the policy order. Writes
bench/results/trace_falsifier.json + .png (latency CDF per policy per load and
regime; ``--smoke``: the tiny checkpoint, 6 requests, no files unless --out). Each regime records when it
ran, its rounds and the machine's load average; a run of some regimes keeps the others' last results.
The second trace, families mixed on one engine, is bench/trace_mixed.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import fv_core
from fv_core.runtime import AsyncEngine, Budget, Engine, SchedulingPolicy
from fv_wan.tiny import write_tiny_checkpoint

MEDIUM = dict(num_attention_heads=8, attention_head_dim=64, ffn_dim=2048, num_layers=8)  # wan_vs_diffusers
PROMPTS = ["a cat running in the forest", "a red car in the city at night", "a boat on the lake at sunset"]
POLICIES = ("fifo", "fair", "auto")
MAX_RUNNING = 16  # requests admitted at once
REGIMES = {  # transformer config (None: the tiny checkpoint's), shapes (frames, height, width), steps
    "medium": dict(transformer=MEDIUM, shapes=[(5, 32, 32), (9, 48, 48), (9, 64, 64)], steps=[2, 4, 8]),
    "tiny": dict(transformer=None, shapes=[(5, 32, 32), (5, 48, 48)], steps=[1, 2]),
}
SMOKE = dict(transformer=None, shapes=[(5, 32, 32), (5, 48, 48)], steps=[1, 2])


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
    budget = Budget(max_running=MAX_RUNNING, max_waiting=len(trace) + 1)
    device = getattr(model.instance, "device", "cpu")
    inner = Engine(budget, device=device, observers=(clock,), scheduling=SchedulingPolicy(policy))
    engine = AsyncEngine(inner, batching=True)
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
    stats = {
        "decisions": inner.decisions.as_dict(),
        "cost_median_rel_error": inner.cost.accuracy()["median_rel_error"],
        "cost_median_rel_error_warm": inner.cost.accuracy()["median_rel_error_warm"],
    }
    return summarize(policy, trace, done, clock, wall) | stats | {"outputs": outputs}


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
        "latencies_s": sorted(lat),
    }


def solo_seconds(model: Any, trace: list[Arrival]) -> float:
    """Warm every shape and prompt; return the trace's mean solo service time."""
    engine, cost = Engine(device=getattr(model.instance, "device", "cpu")), {}
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
    weights: Path, requests: int, loads: list[float], rounds: int, seed: int, mix: dict, device: str = "cpu"
) -> dict[str, Any]:
    """Load the model, draw the trace, serve it at each load under every policy ``rounds`` times."""
    model = fv_core.load(str(weights), device=device)
    trace = make_trace(requests, seed, mix["shapes"], mix["steps"])
    solo_s = solo_seconds(model, trace)
    return {
        "model": {"transformer": mix["transformer"] or "tiny checkpoint"},
        "trace": {
            "requests": requests,
            "seed": seed,
            "mean_solo_service_s": solo_s,
            "shapes_frames_h_w": mix["shapes"],
            "steps": mix["steps"],
            "total_denoise_steps": sum(a.steps for a in trace),
        },
        "loads": {f"{load:g}": serve_load(model, trace, solo_s / load, rounds) for load in loads},
    }


def serve_load(model: Any, trace: list[Arrival], gap_s: float, rounds: int) -> dict[str, Any]:
    """Every policy on the trace at one arrival rate, alternating the order they go in."""
    runs: dict[str, list[dict]] = {p: [] for p in POLICIES}
    outputs: dict[str, dict[int, torch.Tensor]] = {p: {} for p in POLICIES}
    for r in range(rounds):
        order = list(POLICIES) if r % 2 == 0 else list(reversed(POLICIES))
        for policy in order:
            res = asyncio.run(serve_trace(model, trace, gap_s, policy, f"r{r}"))
            for rid, out in res.pop("outputs").items():
                outputs[policy][int(rid.rsplit("-", 1)[1])] = out
            runs[policy].append(res)
    worst = {
        p: max((outputs[p][i] - outputs["fifo"][i]).abs().max().item() for i in range(len(trace)))
        for p in POLICIES
        if p != "fifo"
    }
    policies = {p: median_of(rs) | {"per_round": rs} for p, rs in runs.items()}
    return {
        "mean_interarrival_s": gap_s,
        "policies": policies,
        "auto_vs_best": compare(policies),
        "outputs_max_abs_diff_vs_fifo": worst,
    }


def compare(policies: dict[str, dict]) -> dict[str, float]:
    """auto over the better of fifo and fair per headline metric (latencies: < 1 is better; throughput: > 1),
    and auto's time to first step over fifo's."""
    auto, others = policies["auto"], [policies["fifo"], policies["fair"]]
    out = {k: auto[k] / min(o[k] for o in others) for k in ("latency_p50_s", "latency_p95_s", "ttfs_p50_s")}
    out["throughput_rps"] = auto["throughput_rps"] / max(o["throughput_rps"] for o in others)
    out["throughput_over_fifo"] = auto["throughput_rps"] / policies["fifo"]["throughput_rps"]
    out["ttfs_p50_over_fifo"] = auto["ttfs_p50_s"] / policies["fifo"]["ttfs_p50_s"]
    return out


def median_of(rounds: list[dict]) -> dict[str, Any]:
    """Per numeric metric (and per count of ``decisions``): the median over rounds."""
    out: dict[str, Any] = {
        k: statistics.median([r[k] for r in rounds])
        for k, v in rounds[0].items()
        if isinstance(v, int | float)
    }
    out["decisions"] = {
        k: statistics.median([r["decisions"][k] for r in rounds]) for k in rounds[0]["decisions"]
    }
    return out


def smoke(folder: Path, requests: int = 6) -> dict[str, Any]:
    """The tiny checkpoint, a short trace, one round: the core of the bench, fast."""
    torch.set_num_threads(1)
    write_tiny_checkpoint(folder)
    return run(folder, requests, loads=[1.0], rounds=1, seed=0, mix=SMOKE)


def plot(result: dict[str, Any], path: Path) -> None:
    """Latency CDF per policy, one panel per regime and load (all rounds pooled)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        (regime, load, res) for regime, r in result["regimes"].items() for load, res in r["loads"].items()
    ]
    cols = max(len(r["loads"]) for r in result["regimes"].values())
    rows = len(result["regimes"])
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.4 * rows), squeeze=False)
    for ax, (regime, load, res) in zip(axes.flat, panels, strict=False):
        for policy, stats in res["policies"].items():
            lat = sorted(x for r in stats["per_round"] for x in r["latencies_s"])
            ax.step(lat, [(i + 1) / len(lat) for i in range(len(lat))], where="post", label=policy)
        ax.set_title(f"{regime}, load {load}", fontsize=10)
        ax.set_xlabel("latency (s)")
        ax.set_ylabel("fraction of requests")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument(
        "--loads",
        type=float,
        nargs="+",
        default=[0.5, 1.0, 2.0, 3.0],
        help="arrival rate / solo service rate",
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--regimes", nargs="+", default=list(REGIMES), choices=list(REGIMES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--smoke", action="store_true", help="tiny checkpoint, 6 requests, one round")
    ap.add_argument("--out", help="JSON path (default bench/results/trace_falsifier.json; smoke: none)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    result: dict[str, Any] = {
        "bench": "trace_falsifier",
        "device": args.device,
        "rounds": 1 if args.smoke else args.rounds,
        "torch_threads": args.threads,
        "regimes": {},
    }
    out = args.out or (
        None if args.smoke else str(Path(__file__).parent / "results" / "trace_falsifier.json")
    )
    if out and not args.smoke and Path(out).exists():  # regimes not run now keep their last results
        result["regimes"] = json.loads(Path(out).read_text()).get("regimes", {})
    for name in ["tiny"] if args.smoke else args.regimes:  # the JSON is rewritten after each regime
        started, load_start = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), os.getloadavg()[0]
        with tempfile.TemporaryDirectory() as tmp:
            if args.smoke:
                regime = smoke(Path(tmp))
            else:
                mix = REGIMES[name]
                write_tiny_checkpoint(Path(tmp), transformer=mix["transformer"])
                regime = run(Path(tmp), args.requests, args.loads, args.rounds, args.seed, mix, args.device)
        regime |= {"run_at": started, "rounds": 1 if args.smoke else args.rounds}
        regime["load_average_1m"] = {"start": load_start, "end": os.getloadavg()[0]}
        result["regimes"][name] = regime
        if out:
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            Path(out).write_text(json.dumps(result, indent=2))
            plot(result, Path(out).with_suffix(".png"))
    print(json.dumps(headline(result), indent=2))


def headline(result: dict[str, Any]) -> dict[str, Any]:
    """Per regime and load: each policy's median throughput, p50 / p95 latency, p50 first step; auto's ratios."""
    keys = ("throughput_rps", "latency_p50_s", "latency_p95_s", "ttfs_p50_s")
    return {
        f"{regime} load {load}": {p: {k: round(s[k], 3) for k in keys} for p, s in res["policies"].items()}
        | {"auto_vs_best": {k: round(v, 3) for k, v in res["auto_vs_best"].items()}}
        for regime, r in result["regimes"].items()
        for load, res in r["loads"].items()
    }


if __name__ == "__main__":
    main()
