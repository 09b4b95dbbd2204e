"""Batching gain: the synthetic DiT, 8 requests batched vs serial; throughput ratio.

Writes bench/results/runtime_batching.json with min/median wall seconds of
each mode, requests per second, the ratio, and the max difference between
batched and serial outputs.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from fv_core.parity import compare_results
from fv_core.request import Request
from fv_core.runtime import Engine
from tests.runtime.synthetic import DenoiseLoop, SyntheticModel

REQUESTS, STEPS, REPEATS = 8, 10, 5


def main() -> None:
    torch.set_num_threads(1)
    model = SyntheticModel()
    loop = DenoiseLoop(model)
    items = [(loop, Request(f"r{i}", params={"steps": STEPS}, seed=i), model) for i in range(REQUESTS)]
    Engine().run_batched(items)  # warm up
    timings: dict[str, list[float]] = {"serial": [], "batched": []}
    outputs = {}
    for _ in range(REPEATS):
        for mode in timings:
            engine = Engine(max_batch_rows=REQUESTS)
            t0 = time.perf_counter()
            outputs[mode] = getattr(engine, f"run_{mode}")(items)
            timings[mode].append(time.perf_counter() - t0)
    report = compare_results(outputs["serial"], outputs["batched"], "batched", tolerance=1e-4)
    results = {
        mode: {
            "min_s": min(t),
            "median_s": statistics.median(t),
            "requests_per_s": REQUESTS / statistics.median(t),
        }
        for mode, t in timings.items()
    }
    out = {
        "bench": "runtime_batching",
        "shape": {"requests": REQUESTS, "steps": STEPS, "tokens": 8, "dim": 16, "cfg_forwards_per_step": 2},
        "threads": torch.get_num_threads(),
        "repeats": REPEATS,
        "results": results,
        "throughput_ratio_batched_vs_serial": results["batched"]["requests_per_s"]
        / results["serial"]["requests_per_s"],
        "max_abs_diff_batched_vs_serial": report.max_abs,
    }
    path = Path(__file__).parent / "results" / "runtime_batching.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
