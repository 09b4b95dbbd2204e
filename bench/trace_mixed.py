"""The falsifier's second trace: families mixed on one engine (Wan medium + LTX-2 medium + BAGEL chat + BAGEL t2i).

Usage: python -m bench.trace_mixed [--requests 16] [--loads 0.5 1 2 3] [--rounds 1] [--smoke] [--out PATH]

One seeded Poisson trace draws each request's family (uniformly) and size; every policy (fifo, fair, auto)
serves it on one AsyncEngine holding the three models (``determinism: batched``, up to 16 admitted), with a
fresh engine and cost model per run, rounds alternating the policy order (as bench/trace_falsifier.py).
The arrival rate is ``load`` / the trace's mean solo service time (measured in the warm-up). Reported per
policy: throughput, p50 / p95 latency, time to first step (any WorkUnit), the scheduler's decisions, the
cost model's median |measured / predicted - 1|, and per family p50 / p95 latency and the worst slowdown
(latency / that request's solo time): a family starved on the mixed engine shows there. Writes
bench/results/trace_mixed.json + .png (latency CDF per policy per load; ``--smoke``: tiny checkpoints,
4 requests, one round, no files unless --out).
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
from bench.trace_falsifier import MEDIUM as WAN_MEDIUM
from bench.trace_falsifier import pct
from bench.trace_falsifier import plot as plot_regimes
from fv_core.plugins import load_plugins
from fv_core.runtime import AsyncEngine, Budget, Engine, SchedulingPolicy

POLICIES = ("fifo", "fair", "auto")
FAMILIES = ("wan", "ltx2", "bagel_chat", "bagel_t2i")
MAX_RUNNING = 16
LTX2_MEDIUM = dict(num_layers=8, num_attention_heads=8, attention_head_dim=32, audio_num_attention_heads=8,
                   audio_attention_head_dim=16)  # fmt: skip
BAGEL_MEDIUM = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                    num_key_value_heads=2)  # fmt: skip
SIZES = {  # per family: request params drawn from, per size (medium / smoke)
    "medium": {
        "wan": [dict(num_frames=9, height=48, width=48, num_inference_steps=s) for s in (2, 4)],
        "ltx2": [dict(num_frames=9, height=64, width=64, num_inference_steps=s) for s in (2, 4)],
        "bagel_chat": [dict(max_tokens=n, temperature=0.0) for n in (8, 16)],
        "bagel_t2i": [dict(height=64, width=64, num_inference_steps=s) for s in (2, 4)],
    },
    "smoke": {
        "wan": [dict(num_frames=5, height=32, width=32, num_inference_steps=1)],
        "ltx2": [dict(num_frames=9, height=64, width=64, num_inference_steps=2)],
        "bagel_chat": [dict(max_tokens=4, temperature=0.0)],
        "bagel_t2i": [dict(height=32, width=32, num_inference_steps=2)],
    },
}
PROMPTS = ["a cat running in the forest", "a red car in the city at night", "a boat on the lake at sunset"]


@dataclass(slots=True)
class Arrival:
    """One request of the trace."""

    at_s: float  # arrival offset, in units of the mean inter-arrival time until scaled
    family: str  # one of FAMILIES
    size: int  # index into SIZES[...][family]
    prompt: int  # index into PROMPTS
    seed: int  # request seed


def make_trace(n: int, seed: int, sizes: dict[str, list]) -> list[Arrival]:
    rng, t, out = random.Random(seed), 0.0, []
    for i in range(n):
        family = rng.choice(FAMILIES)
        out.append(
            Arrival(t, family, rng.randrange(len(sizes[family])), rng.randrange(len(PROMPTS)), 1000 + i)
        )
        t += rng.expovariate(1.0)
    return out


class Models:
    """The three loaded models and how each family's request is made."""

    def __init__(self, folder: Path, smoke: bool) -> None:
        from fv_bagel.tiny import write_checkpoint
        from fv_ltx2.tiny import write_tiny_checkpoint as write_ltx2
        from fv_wan.tiny import write_tiny_checkpoint as write_wan

        write_wan(folder / "wan", transformer=None if smoke else WAN_MEDIUM)
        write_ltx2(folder / "ltx2", transformer=None if smoke else LTX2_MEDIUM)
        write_checkpoint(folder / "bagel", llm=None if smoke else BAGEL_MEDIUM)
        host = load_plugins(env={"FV_PLUGINS": "fv-wan,fv-ltx2,fv-bagel"})
        self.wan = fv_core.load(str(folder / "wan"), host=host)
        self.ltx2 = fv_core.load(str(folder / "ltx2"), host=host)
        self.bagel = fv_core.load("bagel-7b-mot", folder / "bagel", host=host)
        self.sizes = SIZES["smoke" if smoke else "medium"]

    def job(self, a: Arrival, rid: str) -> Any:
        params = {"prompt": PROMPTS[a.prompt], "seed": a.seed, **self.sizes[a.family][a.size]}
        if a.family == "wan":
            return self.wan.job(self.wan.prepare(params, request_id=rid))
        if a.family == "ltx2":
            return self.ltx2.job(self.ltx2.prepare(params, request_id=rid))
        task = "chat" if a.family == "bagel_chat" else "t2i"
        return self.bagel.job(self.bagel.prepare(params, task=task, request_id=rid))


class FirstStep:
    """Observer (worker thread): when each request ran its first WorkUnit."""

    def __init__(self) -> None:
        self.first: dict[str, float] = {}

    def on_start(self, state: Any, request: Any) -> None:
        return None

    def on_step(self, state: Any, plan: Any, result: Any) -> None:
        self.first.setdefault(state.request_id, time.perf_counter())

    def on_finish(self, state: Any, result: Any) -> None:
        return None


def solo_seconds(models: Models, trace: list[Arrival]) -> dict[tuple[str, int], float]:
    """Each (family, size) of the trace run alone, after a warm-up run: its solo service time."""
    engine, solo = Engine(), {}
    for a in trace:
        key = (a.family, a.size)
        if key not in solo:
            engine.run_one(*models.job(a, f"warm-{len(solo)}"))
            t0 = time.perf_counter()
            engine.run_one(*models.job(a, f"solo-{len(solo)}"))
            solo[key] = time.perf_counter() - t0
    return solo


async def serve(models: Models, trace: list[Arrival], gap_s: float, policy: str, tag: str) -> dict[str, Any]:
    """Serve the trace under one policy; per request: family, arrival, first step and finish times."""
    clock = FirstStep()
    budget = Budget(max_running=MAX_RUNNING, max_waiting=len(trace) + 1)
    inner = Engine(budget, observers=(clock,), scheduling=SchedulingPolicy(policy))
    engine = AsyncEngine(inner, batching=True)
    done: dict[str, tuple[str, int, float, float]] = {}

    async def one(i: int, a: Arrival) -> None:
        await asyncio.sleep(max(0.0, t0 + a.at_s * gap_s - time.perf_counter()))
        rid, arrived = f"{tag}-{policy}-{i}", time.perf_counter()
        await engine.submit(*models.job(a, rid))
        await engine.result(rid)
        done[rid] = (a.family, a.size, arrived, time.perf_counter())

    async with engine:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(i, a) for i, a in enumerate(trace)))
        wall = time.perf_counter() - t0
    return {
        "wall_s": wall,
        "done": done,
        "first": dict(clock.first),
        "decisions": inner.decisions.as_dict(),
        "cost_median_rel_error": inner.cost.accuracy()["median_rel_error"],
        "cost_median_rel_error_warm": inner.cost.accuracy()["median_rel_error_warm"],
    }


def summarize(run: dict[str, Any], solo: dict[tuple[str, int], float]) -> dict[str, Any]:
    done, first = run["done"], run["first"]
    lat = {rid: f - a for rid, (_, _, a, f) in done.items()}
    out: dict[str, Any] = {
        "requests": len(done),
        "wall_s": run["wall_s"],
        "throughput_rps": len(done) / run["wall_s"],
        "latency_p50_s": pct(list(lat.values()), 0.5),
        "latency_p95_s": pct(list(lat.values()), 0.95),
        "ttfs_p50_s": pct([first[rid] - a for rid, (_, _, a, _) in done.items()], 0.5),
        "cost_median_rel_error": run["cost_median_rel_error"],
        "cost_median_rel_error_warm": run["cost_median_rel_error_warm"],
        "decisions": run["decisions"],
        "latencies_s": sorted(lat.values()),
        "families": {},
    }
    for family in FAMILIES:
        rids = [rid for rid, (f, *_) in done.items() if f == family]
        if rids:
            out["families"][family] = {
                "requests": len(rids),
                "latency_p50_s": pct([lat[r] for r in rids], 0.5),
                "latency_p95_s": pct([lat[r] for r in rids], 0.95),
                "worst_slowdown": max(lat[r] / solo[(family, done[r][1])] for r in rids),
            }
    return out


def serve_load(models: Models, trace: list[Arrival], solo: dict, gap_s: float, rounds: int) -> dict[str, Any]:
    runs: dict[str, list[dict]] = {p: [] for p in POLICIES}
    for r in range(rounds):
        for policy in POLICIES if r % 2 == 0 else tuple(reversed(POLICIES)):
            runs[policy].append(summarize(asyncio.run(serve(models, trace, gap_s, policy, f"r{r}")), solo))
    policies = {p: median_of(rs) | {"per_round": rs} for p, rs in runs.items()}
    auto, others = policies["auto"], [policies["fifo"], policies["fair"]]
    vs_best = {
        k: auto[k] / min(o[k] for o in others) for k in ("latency_p50_s", "latency_p95_s", "ttfs_p50_s")
    }
    vs_best["throughput_rps"] = auto["throughput_rps"] / max(o["throughput_rps"] for o in others)
    return {"mean_interarrival_s": gap_s, "policies": policies, "auto_vs_best": vs_best}


def median_of(rounds: list[dict]) -> dict[str, Any]:
    """Per numeric metric, per decision count and per family metric: the median over rounds."""
    out: dict[str, Any] = {
        k: statistics.median(r[k] for r in rounds) for k, v in rounds[0].items() if isinstance(v, int | float)
    }
    out["decisions"] = {
        k: statistics.median(r["decisions"][k] for r in rounds) for k in rounds[0]["decisions"]
    }
    out["families"] = {
        f: {k: statistics.median(r["families"][f][k] for r in rounds) for k in stats}
        for f, stats in rounds[0]["families"].items()
    }
    return out


def run(requests: int, loads: list[float], rounds: int, seed: int, smoke: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        models = Models(Path(tmp), smoke)
        trace = make_trace(requests, seed, models.sizes)
        solo = solo_seconds(models, trace)
        mean_solo = statistics.fmean(solo[(a.family, a.size)] for a in trace)
        return {
            "bench": "trace_mixed",
            "device": "cpu",
            "torch_threads": torch.get_num_threads(),
            "rounds": rounds,
            "load_average_1m_start": os.getloadavg()[0],
            "models": {"wan": WAN_MEDIUM, "ltx2": LTX2_MEDIUM, "bagel_llm": BAGEL_MEDIUM}
            if not smoke
            else "tiny",
            "trace": {
                "requests": requests,
                "seed": seed,
                "families": {f: sum(a.family == f for a in trace) for f in FAMILIES},
                "sizes": models.sizes,
                "mean_solo_service_s": mean_solo,
                "solo_s": {f"{f} {s}": v for (f, s), v in solo.items()},
            },
            "loads": {
                f"{load:g}": serve_load(models, trace, solo, mean_solo / load, rounds) for load in loads
            },
            "load_average_1m_end": os.getloadavg()[0],
        }


def plot(result: dict[str, Any], path: Path) -> None:
    """Latency CDF per policy, one panel per load (all rounds pooled): the falsifier's plot, one regime."""
    plot_regimes({"regimes": {"mixed families": {"loads": result["loads"]}}}, path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--loads", type=float, nargs="+", default=[0.5, 1.0, 2.0, 3.0])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--smoke", action="store_true", help="tiny checkpoints, 4 requests, load 1, one round")
    ap.add_argument("--out", help="JSON path (default bench/results/trace_mixed.json; smoke: none)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.smoke:
        result = run(4, [1.0], 1, args.seed, smoke=True)
    else:
        result = run(args.requests, args.loads, args.rounds, args.seed, smoke=False)
    out = args.out or (None if args.smoke else str(Path(__file__).parent / "results" / "trace_mixed.json"))
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=2))
        plot(result, Path(out).with_suffix(".png"))
    keys = ("throughput_rps", "latency_p50_s", "latency_p95_s", "ttfs_p50_s")
    print(json.dumps({
        load: {p: {k: round(s[k], 3) for k in keys} | {"worst_slowdown": {f: round(v["worst_slowdown"], 2)
               for f, v in s["families"].items()}} for p, s in res["policies"].items()}
        | {"auto_vs_best": {k: round(v, 3) for k, v in res["auto_vs_best"].items()}}
        for load, res in result["loads"].items()
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
