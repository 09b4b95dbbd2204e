"""fv behind NVIDIA Dynamo: what Dynamo's path costs per request, and cost-aware vs round-robin routing.

One deployment in one run: etcd, NATS, Dynamo's frontend and two ``fv dynamo-worker`` processes of the tiny
Wan card (as tests/plugins/fv_dynamo starts them). Measured, interleaved within the run:

- overhead per request: the same tiny request sent one at a time straight to worker 1's own fv server
  (what ``fv serve`` answers) and through Dynamo's frontend (HTTP -> NATS -> the worker's handler -> its fv
  server): images (synchronous on both paths) and videos (the direct client polls every 10 ms; the worker's
  handler polls its fv server every ``handlers.POLL_S``);
- throughput with 2 workers on a mixed load (a quarter of the jobs 12x longer, seeded order), 8 concurrent
  clients: Dynamo's frontend (its default router), ``Client.round_robin`` and ``fv_dynamo.CostRouter`` (the
  least predicted queued seconds), the last two from the same Dynamo client in this process.

Writes bench/results/dynamo.json and dynamo.png. Run: ``flock /tmp/fv-bench.lock python -m bench.dynamo``
(``--smoke``: fewer requests).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import httpx
import yaml

from tests.plugins.fv_dynamo.conftest import _port_open, _wait, binary
from tests.serving.support import TINY, free_port

OUT = Path(__file__).parent / "results"
NAMESPACE = "fv-bench"
SHORT = {"num_frames": 5, "num_inference_steps": 2}
LONG = {"num_frames": 5, "num_inference_steps": 24}


def video(prompt: str, steps: dict, fmt: str = "url") -> dict:
    return {"model": TINY, "prompt": prompt, "size": "32x32", "response_format": fmt, "nvext": dict(steps)}


class Deployment:
    """etcd, NATS, the frontend and two workers, torn down on exit."""

    def __init__(self, root: Path) -> None:
        self.root, self.procs = root, []
        ports = [free_port() for _ in range(4)]
        self.etcd, self.http = f"http://127.0.0.1:{ports[0]}", ports[3]
        self.env = {"ETCD_ENDPOINTS": self.etcd, "NATS_SERVER": f"nats://127.0.0.1:{ports[2]}",
                    "DYN_DISCOVERY_BACKEND": "etcd", "DYN_REQUEST_PLANE": "nats", "DYN_EVENT_PLANE": "nats"}  # fmt: skip
        self.ports = ports

    def start(self, name: str, *cmd: str) -> None:
        env = {
            **os.environ,
            **self.env,
            "FV_PLUGINS": "fv-wan,fv-dynamo",
            "FV_CACHE_DIR": str(self.root / "cache"),
        }
        out = open(self.root / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        self.procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=self.root))

    def __enter__(self) -> Deployment:
        etcd_port, peer, nats_port, _ = self.ports
        self.start("etcd", binary("etcd"), "--data-dir", str(self.root / "etcd"), "--listen-client-urls", self.etcd,
                   "--advertise-client-urls", self.etcd, "--listen-peer-urls", f"http://127.0.0.1:{peer}")  # fmt: skip
        self.start("nats", binary("nats-server"), "-a", "127.0.0.1", "-p", str(nats_port), "-js", "-sd",
                   str(self.root / "nats"))  # fmt: skip
        _wait("etcd and NATS", lambda: httpx.get(f"{self.etcd}/health").is_success and _port_open(nats_port),
              self.procs, self.root)  # fmt: skip
        self.start("frontend", sys.executable, "-m", "dynamo.frontend", "--http-host", "127.0.0.1",
                   "--http-port", str(self.http), "--namespace", NAMESPACE)  # fmt: skip
        for w in ("w1", "w2"):
            deploy = {"plugins": ["fv-wan"], "models": [{"card": TINY}], "data_dir": str(self.root / w),
                      "determinism": "bitwise", "shutdown_grace_s": 0, "limits": {"max_running": 4, "max_steps": 100}}  # fmt: skip
            (self.root / f"{w}.yaml").write_text(yaml.safe_dump(deploy))
            self.start(
                w, binary("fv"), "dynamo-worker", str(self.root / f"{w}.yaml"), "--namespace", NAMESPACE
            )

        def ready() -> bool:
            logs = [(self.root / f"{w}.log").read_text() for w in ("w1", "w2")]
            models = httpx.get(f"http://127.0.0.1:{self.http}/v1/models").json()["data"]
            return all("fv-dynamo: ready" in log for log in logs) and {m["id"] for m in models} == {TINY}

        _wait("the workers", ready, self.procs, self.root, timeout=300)
        text = (self.root / "w1.log").read_text()
        self.worker_url = text.split("ready, fv server at ", 1)[1].split()[0]
        self.frontend_url = f"http://127.0.0.1:{self.http}"
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in reversed(self.procs):
            proc.terminate()
        for proc in reversed(self.procs):
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()


async def direct_video(http: httpx.AsyncClient, prompt: str, steps: dict) -> None:
    job = (
        await http.post("/v1/videos", json={"model": TINY, "prompt": prompt, "size": "32x32", **steps})
    ).json()
    while job["status"] in ("queued", "in_progress"):
        await asyncio.sleep(0.01)
        job = (await http.get(f"/v1/videos/{job['id']}")).json()
    assert job["status"] == "completed", job


async def frontend_video(http: httpx.AsyncClient, prompt: str, steps: dict) -> None:
    answer = (await http.post("/v1/videos", json=video(prompt, steps))).json()
    assert answer["status"] == "completed", answer


async def overhead(dep: Deployment, repeats: int) -> dict:
    """Latency of one request at a time, straight to the worker's fv server and through Dynamo, alternating."""
    image = {"model": TINY, "prompt": "a square", "size": "32x32"}
    times: dict[str, list[float]] = {k: [] for k in ("image_fv", "image_dynamo", "video_fv", "video_dynamo")}
    async with httpx.AsyncClient(base_url=dep.worker_url, timeout=120) as fv, \
            httpx.AsyncClient(base_url=dep.frontend_url, timeout=120) as dyn:  # fmt: skip
        calls = {
            "image_fv": lambda i: fv.post("/v1/images/generations", json={**image, "seed": i, **SHORT}),
            "image_dynamo": lambda i: dyn.post("/v1/images/generations", json={**image, "nvext": {"seed": i, **SHORT}}),
            "video_fv": lambda i: direct_video(fv, f"a fox {i}", SHORT),
            "video_dynamo": lambda i: frontend_video(dyn, f"a fox {i}", SHORT),
        }  # fmt: skip
        for i in range(repeats + 2):  # the first two warm up
            for name in calls if i % 2 == 0 else reversed(list(calls)):
                start = time.perf_counter()
                await calls[name](i)
                if i >= 2:
                    times[name].append(time.perf_counter() - start)
    out = {k: {"min_s": min(v), "median_s": statistics.median(v)} for k, v in times.items()}
    for kind in ("image", "video"):
        out[f"{kind}_overhead_ms"] = {
            stat: (out[f"{kind}_dynamo"][f"{stat}_s"] - out[f"{kind}_fv"][f"{stat}_s"]) * 1000
            for stat in ("min", "median")
        }
    return out


async def throughput(dep: Deployment, jobs: int, clients: int, seed: int) -> dict:
    """The same mixed load through the frontend, Client.round_robin and CostRouter (2 workers)."""
    from dynamo.runtime import DistributedRuntime

    from fv_dynamo import CostRouter

    rng = random.Random(seed)
    load = [LONG if rng.random() < 0.25 else SHORT for _ in range(jobs)]
    runtime = DistributedRuntime(asyncio.get_running_loop(), "etcd", "nats")
    try:
        router = await CostRouter.connect(runtime, NAMESPACE, TINY)

        async def via_round_robin(body: dict) -> None:
            answers = [a.data() async for a in await router.requests.round_robin(body)]
            assert answers[-1]["status"] == "completed", answers

        async def via_cost(body: dict) -> None:
            answers = [a async for a in router.send(body)]
            assert answers[-1]["status"] == "completed", answers

        async with httpx.AsyncClient(base_url=dep.frontend_url, timeout=300) as dyn:

            async def via_frontend(body: dict) -> None:
                answer = (await dyn.post("/v1/videos", json=body)).json()
                assert answer["status"] == "completed", answer

            policies = [
                ("frontend", via_frontend),
                ("round_robin", via_round_robin),
                ("cost_aware", via_cost),
            ]
            results = {}
            for name, send in policies[seed % 3 :] + policies[: seed % 3]:  # each round starts elsewhere
                results[name] = await run_load(name, send, load, clients)
            return {name: results[name] for name, _ in policies}
    finally:
        runtime.shutdown()


async def run_load(name: str, send, load: list[dict], clients: int) -> dict:
    """``load``'s jobs from ``clients`` concurrent clients through ``send``: jobs/s and latencies."""
    queue = list(enumerate(load))
    latencies: dict[str, list[float]] = {"short": [], "long": []}

    async def client() -> None:
        while queue:
            i, steps = queue.pop(0)
            start = time.perf_counter()
            await send(video(f"{name} {i}", steps))
            latencies["long" if steps is LONG else "short"].append(time.perf_counter() - start)

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    wall = time.perf_counter() - start
    short = sorted(latencies["short"])
    return {
        "wall_s": wall,
        "jobs_per_s": len(load) / wall,
        "short_p50_s": statistics.median(short),
        "short_p95_s": short[max(0, round(0.95 * len(short)) - 1)],
        "long_p50_s": statistics.median(latencies["long"] or [0.0]),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    repeats, jobs, rounds = (3, 12, 1) if args.smoke else (12, 48, 3)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp, Deployment(Path(tmp)) as dep:
        for name, value in dep.env.items():
            os.environ[name] = value
        over = asyncio.run(overhead(dep, repeats))
        runs = [asyncio.run(throughput(dep, jobs, 8, seed=r)) for r in range(rounds)]
    policies = list(runs[0])
    summary = {
        p: {
            "jobs_per_s_max": max(r[p]["jobs_per_s"] for r in runs),
            "jobs_per_s_median": statistics.median(r[p]["jobs_per_s"] for r in runs),
            "short_p95_s_min": min(r[p]["short_p95_s"] for r in runs),
            "short_p95_s_median": statistics.median(r[p]["short_p95_s"] for r in runs),
        }
        for p in policies
    }
    report = {
        "what": "tiny Wan card (32x32, 5 frames; short 2 steps, long 24), 2 fv dynamo-workers behind Dynamo 1.4.2 "
        "(etcd, NATS request plane); overhead: one request at a time, fv's own server vs Dynamo's frontend, "
        f"alternating, {repeats} each; throughput: {jobs} jobs (a quarter long, seeded) from 8 clients, {rounds} rounds",
        "cores": os.cpu_count(),
        "machine": platform.platform(),
        "load_avg_1m_before": load_before,
        "load_avg_1m_after": os.getloadavg()[0],
        "smoke": args.smoke,
        "overhead": over,
        "throughput": summary,
        "cost_aware_vs_round_robin_jobs_per_s": summary["cost_aware"]["jobs_per_s_median"]
        / summary["round_robin"]["jobs_per_s_median"],
        "cost_aware_vs_round_robin_short_p95": summary["cost_aware"]["short_p95_s_median"]
        / summary["round_robin"]["short_p95_s_median"],
        "runs": runs,
    }
    OUT.mkdir(exist_ok=True)
    name = "dynamo_smoke" if args.smoke else "dynamo"
    (OUT / f"{name}.json").write_text(json.dumps(report, indent=2))
    plot(report, OUT / f"{name}.png")
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=2))


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    over = report["overhead"]
    kinds = ["image_fv", "image_dynamo", "video_fv", "video_dynamo"]
    left.bar(kinds, [over[k]["median_s"] * 1000 for k in kinds], color=["C0", "C1", "C0", "C1"])
    left.set(ylabel="latency, median (ms)", title="one request: fv's server vs through Dynamo")
    left.tick_params(axis="x", rotation=20)
    policies = list(report["throughput"])
    right.bar(
        policies, [report["throughput"][p]["jobs_per_s_median"] for p in policies], color=["C1", "C2", "C3"]
    )
    right.set(ylabel="jobs/s (median of rounds)", title="2 workers, mixed load, 8 clients")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
