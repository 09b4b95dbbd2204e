"""The fleet's scale run (``python -m bench.fleet --scale``): 16 clients x 200 jobs of the tiny Wan card
(tiny requests) against 2 replica processes that share only PostgreSQL and an artifact folder; replica 0
is SIGKILLed when half the jobs are done. Checked, not just timed:

- no job lost: every job a client created ends completed, or failed with ``server_restart`` (it was running
  on the killed replica), and the job table holds no other row;
- none run twice: the surviving replica's ``fv_jobs_total{status="completed"}`` equals the completed rows it
  owns, and it cancelled none (a job finished by both would be refused to the second and counted cancelled);
- every completed job downloads through the survivor.

Writes bench/results/fleet_scale.json and .png (completions over time, the kill marked). ``--smoke``: 4 x 10.
"""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai

from bench.fleet import OUT, REQUEST, start_replicas
from fv_core.serving.store import Database
from tests.serving.postgres import PostgresCluster
from tests.serving.support import TINY, tiny_deploy

POLL_S = 0.2


class Fleet:
    """The replicas' URLs as the clients see them: a replica that stopped answering is dropped."""

    def __init__(self, urls: list[str]) -> None:
        self.urls, self.dead = urls, set[str]()

    def pick(self, n: int) -> str:
        live = [u for u in self.urls if u not in self.dead]
        return live[n % len(live)]


def client_run(fleet: Fleet, c: int, jobs: int, done: list, lock: threading.Lock, t0: float) -> list[str]:
    """One client: ``jobs`` jobs one after another, each polled to its end through any live replica."""
    apis = {u: openai.OpenAI(base_url=f"{u}/v1", api_key="-", max_retries=2, timeout=120) for u in fleet.urls}
    ids = []
    for j in range(jobs):
        while True:
            url = fleet.pick(c + j)
            try:
                video = apis[url].videos.create(prompt=f"client {c} job {j}", model=TINY, **REQUEST)
                break
            except openai.APIConnectionError:  # that replica was killed: the job never reached it
                fleet.dead.add(url)
        ids.append(video.id)
        start = time.perf_counter()
        while video.status not in ("completed", "failed"):
            time.sleep(POLL_S)
            url = fleet.pick(c + j)
            try:
                video = apis[url].videos.retrieve(video.id)
            except openai.APIConnectionError:
                fleet.dead.add(url)
        with lock:
            done.append((time.perf_counter() - t0, time.perf_counter() - start, video.status))
    return ids


def jobs_total(url: str, status: str) -> int:
    found = re.search(
        rf'^fv_jobs_total{{model="{TINY}",status="{status}"}} (\S+)$', httpx.get(f"{url}/metrics").text, re.M
    )
    return int(float(found[1])) if found else 0


def main(smoke: bool) -> dict:
    clients, per_client = (4, 10) if smoke else (16, 200)
    total = clients * per_client
    base = tiny_deploy("unused", max_running=4, max_steps=50, max_queue=64).model_dump(mode="json")
    load_before = os.getloadavg()
    with PostgresCluster(fsync=True) as pg, tempfile.TemporaryDirectory() as tmp:
        root, url = Path(tmp), pg.database()
        deploy = {**base, "store": url, "artifacts": f"file://{root / 'shared'}", "shutdown_grace_s": 0}
        replicas = start_replicas(2, deploy, root, shared_dir=False)
        (killed, killed_url), (survivor, survivor_url) = replicas
        fleet, done, lock, t0 = Fleet([killed_url, survivor_url]), [], threading.Lock(), time.perf_counter()
        killed_at = None
        try:
            with ThreadPoolExecutor(clients) as pool:
                futures = [
                    pool.submit(client_run, fleet, c, per_client, done, lock, t0) for c in range(clients)
                ]
                while len(done) < total // 2 and not any(f.done() for f in futures):
                    time.sleep(0.1)
                killed.kill()
                killed.wait(30)
                killed_at = time.perf_counter() - t0
                fleet.dead.add(killed_url)
                ids = [i for f in futures for i in f.result()]
            wall = time.perf_counter() - t0
            db = Database(url)
            rows = {
                r[0]: r[1:] for r in db.execute("SELECT id, status, error_code, owner FROM jobs").fetchall()
            }
            db.close()
            survivor_id = next(
                o for _, _, o in rows.values() if o and o.startswith("r1-")
            )  # start_replicas' ids
            completed = [i for i in ids if rows[i][0] == "completed"]
            restarted = [i for i in ids if rows[i][0] == "failed" and rows[i][1] == "server_restart"]
            other_failures = [(i, rows[i]) for i in ids if i not in completed and i not in restarted]
            by_survivor = [i for i in completed if rows[i][2] == survivor_id]
            ran_by_survivor = jobs_total(survivor_url, "completed")
            cancelled_by_survivor = jobs_total(survivor_url, "cancelled")
            sample = completed[:: max(1, len(completed) // 20)]
            downloads_ok = all(
                len(httpx.get(f"{survivor_url}/v1/videos/{i}/content", timeout=60).content) > 1000
                for i in sample
            )
        finally:
            for proc, _ in replicas:
                proc.kill()
                proc.wait(30)
    latencies = sorted(d[1] for d in done)
    report = {
        "what": f"{clients} clients x {per_client} jobs (tiny Wan card, 32x32, 5 frames, 4 steps) against 2 replica "
        "processes sharing PostgreSQL (fsync on) and an artifact folder; replica 0 SIGKILLed when half were done",
        "cores": os.cpu_count(),
        "machine": platform.platform(),
        "load_avg_1m_before": load_before[0],
        "load_avg_1m_after": os.getloadavg()[0],
        "smoke": smoke,
        "jobs": total,
        "created": len(ids),
        "rows_in_job_table": len(rows),
        "completed": len(completed),
        "failed_server_restart": len(restarted),
        "failed_otherwise": len(other_failures),
        "lost": total - len(completed) - len(restarted) - len(other_failures) + (len(rows) - len(ids)),
        "survivor_completed_metric": ran_by_survivor,
        "survivor_completed_rows": len(by_survivor),
        "survivor_cancelled_metric": cancelled_by_survivor,
        "run_twice": ran_by_survivor - len(by_survivor) + cancelled_by_survivor,
        "downloads_checked": len(sample),
        "downloads_ok": downloads_ok,
        "killed_at_s": killed_at,
        "wall_s": wall,
        "jobs_per_s": total / wall,
        "p50_s": statistics.median(latencies),
        "p95_s": latencies[max(0, round(0.95 * len(latencies)) - 1)],
        "timeline": [[round(t, 3), s] for t, _, s in sorted(done)],
    }
    assert report["lost"] == 0 and report["run_twice"] == 0 and not other_failures and downloads_ok, report
    OUT.mkdir(exist_ok=True)
    name = "fleet_scale_smoke" if smoke else "fleet_scale"
    (OUT / f"{name}.json").write_text(json.dumps(report, indent=2))
    plot(report, OUT / f"{name}.png")
    summary = {k: v for k, v in report.items() if k != "timeline"}
    print(json.dumps(summary, indent=2))
    return summary


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    times = [t for t, _ in report["timeline"]]
    ax.plot(times, range(1, len(times) + 1), label="jobs finished")
    ax.axvline(report["killed_at_s"], color="red", linestyle="--", label="replica 0 killed")
    ax.set(xlabel="seconds", ylabel="jobs finished")
    ax.set_title(f"{report['jobs']} jobs, 2 replicas on PostgreSQL:\n{report['completed']} completed, "
                 f"{report['failed_server_restart']} server_restart, {report['lost']} lost, "
                 f"{report['run_twice']} run twice", fontsize=10)  # fmt: skip
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
