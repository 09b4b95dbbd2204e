"""The fleet across hosts: jobs/s of 1, 2 and 4 replicas (server processes) of the tiny Wan card, on the
embedded store (SQLite in one shared data dir: one host) and on PostgreSQL (each replica its own data dir,
artifacts in a shared folder: what many hosts run), side by side; p50 / p95 latency (create -> completed,
polled), and the store's own cost per job measured alone (the writes and reads one job makes:
create, progress per step, complete with its artifact, polls, download lookup).

Writes bench/results/fleet.json and fleet.png. Run: ``flock /tmp/fv-bench.lock python -m bench.fleet``
(``--smoke``: fewer jobs, 1 and 2 replicas).

``--scale``: the scale run instead (``bench.fleet_scale``): 16 clients x 200 jobs against 2 replicas on
PostgreSQL, one replica killed mid-run; no job lost or run twice (fleet_scale.json and .png).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

from fv_core.serving.jobs import JobStore, new_job_id
from tests.serving.postgres import PostgresCluster
from tests.serving.support import TINY, tiny_deploy

REQUEST = {"size": "32x32", "extra_body": {"num_frames": 5, "num_inference_steps": 4}}
STEPS = 4
OUT = Path(__file__).parent / "results"


def start_replicas(n: int, deploy: dict, root: Path, shared_dir: bool) -> list[tuple[subprocess.Popen, str]]:
    """``n`` replica processes; each prints its port once serving."""
    procs = []
    for i in range(n):
        data = root / ("data" if shared_dir else f"data-{i}")
        path = root / f"replica-{i}.json"
        path.write_text(json.dumps({**deploy, "data_dir": str(data)}))
        env = {**os.environ, "FV_CACHE_DIR": str(root / "cache")}
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "tests.serving.replica", str(path), f"r{i}-{time.monotonic_ns()}"],
                stdout=subprocess.PIPE,
                text=True,
                env=env,
            )
        )
    out = []
    for proc in procs:
        line = proc.stdout.readline() if proc.stdout else ""
        if not line.startswith("port "):
            for started in procs:  # none is left behind
                started.terminate()
            raise RuntimeError(f"a replica did not start: {line!r}")
        out.append((proc, f"http://127.0.0.1:{line.split()[1]}"))
    return out


def run_load(urls: list[str], jobs: int, clients: int) -> dict:
    """``jobs`` jobs from ``clients`` threads, round robin over the replicas; jobs/s and latencies."""
    latencies: list[float] = []
    lock = threading.Lock()
    counter = iter(range(jobs))

    def client(c: int) -> None:
        apis = [openai.OpenAI(base_url=f"{u}/v1", api_key="-", max_retries=5, timeout=120) for u in urls]
        for n in counter:
            api = apis[n % len(apis)]
            start = time.perf_counter()
            video = api.videos.create(prompt=f"a boat {n}", model=TINY, **REQUEST)
            while video.status not in ("completed", "failed"):
                time.sleep(0.05)
                video = api.videos.retrieve(video.id)
            assert video.status == "completed", video
            with lock:
                latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))
    wall = time.perf_counter() - start
    latencies.sort()
    return {
        "jobs": jobs,
        "wall_s": wall,
        "jobs_per_s": jobs / wall,
        "p50_s": statistics.median(latencies),
        "p95_s": latencies[max(0, round(0.95 * len(latencies)) - 1)],
    }


def store_cost(url: str | None, root: Path, jobs: int, polls: int = 5) -> float:
    """Seconds of store work per job (create, a progress write per step, complete with its mp4, polls)."""
    store = JobStore(root, owner="bench", store=url)
    start = time.perf_counter()
    for _ in range(jobs):
        job_id = new_job_id()
        store.create(
            job_id, TINY, "32x32", "auto", "a boat", {"raw": {"seed": 1}, "task": "t2v", "plugin_options": {}}
        )
        for step in range(STEPS):
            store.progress(job_id, 100 * step // STEPS)
            store.get(job_id)
        store.video_path(job_id).write_bytes(b"\0" * 20_000)
        store.video_path(job_id).with_suffix(".json").write_text("{}")
        store.complete(job_id, "32x32", "0.3")
        for _ in range(polls):
            store.get(job_id)
        store.artifact(job_id)
    cost = (time.perf_counter() - start) / jobs
    store.close()
    return cost


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument(
        "--scale", action="store_true", help="16 clients x 200 jobs, a replica killed mid-run"
    )
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    if args.scale:
        from bench.fleet_scale import main as scale

        return scale(args.smoke)
    counts = [1, 2] if args.smoke else [1, 2, 4]
    jobs, repeats = (6, 1) if args.smoke else (24, 4)
    base = tiny_deploy("unused", max_running=4, max_steps=50, max_queue=64).model_dump(mode="json")
    results: dict = {"sqlite": {}, "postgresql": {}}
    with PostgresCluster(fsync=True) as pg, tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        cost = {
            "sqlite": min(store_cost(None, root / f"cost-sqlite-{r}", 200) for r in range(3)),
            "postgresql": min(store_cost(pg.database(), root / f"cost-pg-{r}", 200) for r in range(3)),
        }
        for n in counts:  # both fleets of n replicas up at once, their runs alternating: one machine load
            fleets = {}
            try:
                for kind in ("sqlite", "postgresql"):
                    where = root / f"{kind}-{n}"
                    where.mkdir()
                    deploy = dict(base)
                    if kind == "postgresql":
                        deploy.update(store=pg.database(), artifacts=f"file://{where / 'shared'}")
                    fleets[kind] = start_replicas(n, deploy, where, shared_dir=kind == "sqlite")
                    run_load([u for _, u in fleets[kind]], max(2, n), n * 2)  # warm-up
                runs: dict[str, list[dict]] = {"sqlite": [], "postgresql": []}
                for r in range(repeats):
                    for kind in ("sqlite", "postgresql") if r % 2 == 0 else ("postgresql", "sqlite"):
                        runs[kind].append(run_load([u for _, u in fleets[kind]], jobs, max(4, n * 4)))
            finally:
                for proc, _ in [p for replicas in fleets.values() for p in replicas]:
                    proc.terminate()
                    proc.wait(60)
            for kind, done in runs.items():
                results[kind][n] = {
                    "jobs_per_s_max": max(r["jobs_per_s"] for r in done),
                    "jobs_per_s_median": statistics.median(r["jobs_per_s"] for r in done),
                    "p50_s_min": min(r["p50_s"] for r in done),
                    "p95_s_min": min(r["p95_s"] for r in done),
                    "runs": done,
                }
                print(kind, n, json.dumps(done), flush=True)
            write(
                results, cost, args.smoke, jobs, repeats
            )  # what is measured so far stays, whatever comes next
    print(json.dumps(write(results, cost, args.smoke, jobs, repeats)))


def write(results: dict, cost: dict, smoke: bool, jobs: int, repeats: int) -> dict:
    """The report of the replica counts measured so far, as JSON and PNG; returns its summary."""
    scaling = {
        kind: {n: r[n]["jobs_per_s_max"] / r[1]["jobs_per_s_max"] for n in r} for kind, r in results.items()
    }
    report = {
        "what": "jobs/s of N replica processes of the tiny Wan card (32x32, 5 frames, 4 steps), SQLite (one "
        "shared data dir) vs PostgreSQL (own data dirs, shared artifact folder), both fleets up at once and their "
        "runs alternating; store cost per job alone (min of 3 x 200 jobs)",
        "cores": os.cpu_count(),
        "machine": platform.platform(),
        "load_avg_1m_at_write": os.getloadavg()[0],  # other work on the machine meanwhile
        "smoke": smoke,
        "jobs_per_run": jobs,
        "repeats": repeats,
        "store_ms_per_job": {k: v * 1000 for k, v in cost.items()},
        "postgres_overhead_ms_per_job": (cost["postgresql"] - cost["sqlite"]) * 1000,
        "goal_overhead_ms": 5.0,
        "scaling": scaling,
        "goal_scaling_at_2": 1.8,
        "results": results,
    }
    OUT.mkdir(exist_ok=True)
    name = "fleet_smoke" if smoke else "fleet"
    (OUT / f"{name}.json").write_text(json.dumps(report, indent=2))
    plot(report, OUT / f"{name}.png")
    return {k: report[k] for k in ("store_ms_per_job", "postgres_overhead_ms_per_job", "scaling")}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for kind, marker in (("sqlite", "o"), ("postgresql", "s")):
        counts = sorted(int(n) for n in report["results"][kind])
        left.plot(
            counts, [report["results"][kind][n]["jobs_per_s_max"] for n in counts], marker=marker, label=kind
        )
        right.plot(
            counts, [report["results"][kind][n]["p95_s_min"] for n in counts], marker=marker, label=kind
        )
    left.set(
        xlabel="replicas", ylabel="jobs/s (max of repeats)", title=f"throughput ({report['cores']} cores)"
    )
    right.set(xlabel="replicas", ylabel="p95 latency (s)", title="p95 latency")
    left.legend(), right.legend()
    fig.suptitle(f"store cost per job: SQLite {report['store_ms_per_job']['sqlite']:.2f} ms, PostgreSQL "
                 f"{report['store_ms_per_job']['postgresql']:.2f} ms")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
