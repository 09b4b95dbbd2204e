"""Scheduler overhead: time per WorkUnit with null-work loops, for 1, 100 and 1,000 concurrent requests.

Also measures 1,000 waiting behind 10 running (admission-limited) to show
the cost is flat in the number of waiting requests. Writes
bench/results/runtime_scheduler.json. Goal: < 50 us per unit, flat.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from fv_core.request import Request
from fv_core.runtime import Budget, Engine
from tests.runtime.synthetic import NullLoop

STEPS, REPEATS = 20, 5


def per_unit_us(concurrent: int, max_running: int) -> list[float]:
    times = []
    for _ in range(REPEATS):
        engine = Engine(Budget(max_running=max_running, max_waiting=concurrent + 1))
        items = [(NullLoop(), Request(f"r{i}", params={"steps": STEPS}), None) for i in range(concurrent)]
        t0 = time.perf_counter()
        engine.run_interleaved(items)
        times.append((time.perf_counter() - t0) / (concurrent * STEPS) * 1e6)
    return times


def main() -> None:
    cases = {f"{n}_running": (n, n) for n in (1, 100, 1000)}
    cases["1000_waiting_behind_10_running"] = (1000, 10)
    results = {}
    for name, (n, running) in cases.items():
        t = per_unit_us(n, running)
        results[name] = {
            "requests": n,
            "max_running": running,
            "min_us": min(t),
            "median_us": statistics.median(t),
        }
    base = results["1_running"]["median_us"]
    for r in results.values():
        r["ratio_vs_1"] = r["median_us"] / base
    out = {
        "bench": "runtime_scheduler",
        "unit": "microseconds per WorkUnit (includes init/finalize per request, profiler, events)",
        "steps_per_request": STEPS,
        "repeats": REPEATS,
        "goal_us": 50,
        "results": results,
    }
    path = Path(__file__).parent / "results" / "runtime_scheduler.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
