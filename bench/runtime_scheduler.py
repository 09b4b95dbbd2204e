"""Scheduler overhead: time per WorkUnit with null-work loops against the number of live requests.

Sweeps 1, 10, 100, 300 and 1,000 requests running at once (20 null steps each),
plus 1,000 waiting behind 10 running, twice: on the process heap as imported
(~180k objects from torch) and after ``freeze_heap()`` (what a server does once
its models are loaded). Repeats are interleaved across cases so machine noise
hits all of them alike. Writes bench/results/runtime_scheduler.json and .png.
Goals: < 50 us per unit; at 1,000 live <= 1.2x the cost at 1.
"""

from __future__ import annotations

import gc
import json
import statistics
import time
from pathlib import Path

from fv_core.request import Request
from fv_core.runtime import Budget, Engine
from fv_core.runtime.engine import freeze_heap
from tests.runtime.synthetic import NullLoop

STEPS, REPEATS, UNITS = 20, 9, 20_000  # steps per request, repeats, WorkUnits per measurement
LIVE = (1, 10, 100, 300, 1000)
CASES = {f"{n}_running": (n, n) for n in LIVE} | {"1000_waiting_behind_10_running": (1000, 10)}
OUT = Path(__file__).parent / "results" / "runtime_scheduler"


def per_unit_us(requests: int, max_running: int, engine_cls: type[Engine] = Engine) -> tuple[float, float]:
    """CPU and wall time per WorkUnit of run_interleaved over ``requests`` null loops at once, repeated
    until UNITS units ran (init/finalize included). CPU time is the headline: other processes share
    the cores, so wall time of the longer runs includes time spent descheduled."""
    engine = engine_cls(Budget(max_running=max_running, max_waiting=requests + 1))
    rounds = max(1, UNITS // (requests * STEPS))
    batches = [
        [(NullLoop(), Request(f"r{k}-{i}", params={"steps": STEPS}), None) for i in range(requests)]
        for k in range(rounds)
    ]
    c0, t0 = time.process_time(), time.perf_counter()
    for items in batches:
        engine.run_interleaved(items)
    units = rounds * requests * STEPS
    return (time.process_time() - c0) / units * 1e6, (time.perf_counter() - t0) / units * 1e6


def sweep(engine_cls: type[Engine] = Engine) -> dict[str, dict]:
    times: dict[str, list[float]] = {name: [] for name in CASES}
    walls: dict[str, list[float]] = {name: [] for name in CASES}
    for _ in range(REPEATS):
        for name, (n, running) in CASES.items():
            cpu, wall = per_unit_us(n, running, engine_cls)
            times[name].append(cpu)
            walls[name].append(wall)
    base = statistics.median(times["1_running"])
    return {
        name: {
            "requests": n,
            "max_running": running,
            "min_us": min(times[name]),
            "median_us": statistics.median(times[name]),
            "ratio_vs_1": statistics.median(times[name]) / base,
            "wall_min_us": min(walls[name]),
            "wall_median_us": statistics.median(walls[name]),
        }
        for name, (n, running) in CASES.items()
    }


def plot(results: dict[str, dict[str, dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for heap, rows in results.items():
        med = [rows[f"{n}_running"]["median_us"] for n in LIVE]
        low = [rows[f"{n}_running"]["min_us"] for n in LIVE]
        ax.plot(LIVE, med, marker="o", label=f"{heap} heap: median")
        ax.plot(LIVE, low, linestyle=":", marker=".", label=f"{heap} heap: min")
    ax.set_xscale("log")
    ax.set_ylim(bottom=0)
    ax.set_xlabel("live requests")
    ax.set_ylabel("CPU us per WorkUnit")
    ax.set_title(f"scheduler overhead, null steps ({REPEATS} repeats)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    results = {"imported": sweep()}
    freeze_heap()
    results["frozen"] = sweep()
    gc.unfreeze()
    out = {
        "bench": "runtime_scheduler",
        "unit": "CPU microseconds per WorkUnit (process_time; includes init/finalize per request, profiler, events, GC)",
        "steps_per_request": STEPS,
        "repeats": REPEATS,
        "goal_us": 50,
        "goal_ratio_1000_vs_1": 1.2,
        "heaps": {
            "imported": "process heap as imported (torch etc.): full GC collections scan all of it",
            "frozen": "after fv_core.runtime.engine.freeze_heap() (gc.collect + gc.freeze)",
        },
        "results": results,
    }
    OUT.parent.mkdir(exist_ok=True)
    OUT.with_suffix(".json").write_text(json.dumps(out, indent=2))
    plot(results, OUT.with_suffix(".png"))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
