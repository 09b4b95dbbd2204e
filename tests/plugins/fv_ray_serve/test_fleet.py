"""Two Ray Serve replicas of the tiny Wan model behind the real Serve HTTP proxy, on two Ray nodes, with
the jobs in PostgreSQL and the artifacts in a shared folder (what a fleet across hosts runs).

One module-scoped Ray cluster of two nodes started with ``ray start`` (a head and a worker, one CPU
each: one replica per node) and a throwaway PostgreSQL cluster. "Either replica" is addressed by
pinning: the deployment runs Ray's consistent-hash request router with strict affinity, so every
request carrying one ``x-session-id`` lands on one replica; every answer names its replica in
``x-fv-replica``, so the tests find a session id for each replica and then talk to each on purpose.
Requests without a session id spread over both replicas. A trainer's weight push through the proxy
lands on one replica and goes live on both.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

import fv_core
from fv_core.serving.jobs import JobStore, new_job_id
from fv_core.training import WeightSyncPlan, push_weights
from fv_ray_serve import QUEUE_DEPTH, applications, split_fleet
from tests.plugins.fv_ray_serve.ray_nodes import RayNodes
from tests.serving.postgres import PostgresCluster
from tests.serving.support import TINY, free_port, wan_host

QUICK = {"size": "32x32", "num_frames": 5, "num_inference_steps": 2}
LONG = {
    "size": "160x160",
    "num_frames": 41,
    "num_inference_steps": 200,
}  # ~9 s on one replica: cancellable mid-run


@dataclass
class Fleet:
    http: httpx.Client
    shared: Path  # the artifact folder every node reads
    name: str  # the Serve application
    store: str  # the PostgreSQL job store's URL
    data: Path  # each node's own data dir (staging only)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    data, shared = tmp_path_factory.mktemp("fleet-data"), tmp_path_factory.mktemp("fleet-shared")
    env = {"FV_PLUGINS": "fv-wan", "FV_CACHE_DIR": str(tmp_path_factory.mktemp("fv-cache"))}  # every worker's
    with PostgresCluster() as pg, RayNodes(env) as _:
        store = pg.database()
        yield from _serve(data, shared, store)


def _serve(data: Path, shared: Path, store: str):
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    deploy, scale = split_fleet(
        {
            "plugins": ["fv-wan"],
            "models": [{"card": TINY}],
            "data_dir": str(data),
            "store": store,
            "artifacts": f"file://{shared}",
            "limits": {"max_frames": 41, "max_steps": 200, "max_queue": 64, "max_running": 4},
            "shutdown_grace_s": 0,
            "fleet": {
                "models": {
                    TINY: {
                        "replicas": 2,
                        "max_replicas_per_node": 1,
                        "ray_actor_options": {"num_cpus": 1},
                    }
                }
            },  # fmt: skip
        }
    )
    pin = RequestRouterConfig(
        request_router_class="ray.serve.experimental.consistent_hash_router:ConsistentHashRouter",
        request_router_kwargs={"num_fallback_replicas": 0},
    )
    [(name, app, prefix)] = applications(deploy, scale, options={"request_router_config": pin})
    serve.run(app, name=name, route_prefix=prefix)
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
        yield Fleet(http, shared, name, store, data)
    serve.shutdown()


@pytest.fixture(scope="module")
def sessions(fleet):
    """A session id pinned to each replica: {replica id: session id}."""
    http = fleet.http
    found: dict[str, str] = {}
    for i in range(200):
        replica = http.get("/health", headers={"x-session-id": f"s{i}"}).headers["x-fv-replica"]
        found.setdefault(replica, f"s{i}")
        if len(found) == 2:
            return found
    raise AssertionError(f"only replicas {sorted(found)} answered")


def _on(session: str) -> dict[str, str]:
    return {"x-session-id": session}


def _wait(http, job_id, headers, until, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        video = http.get(f"/v1/videos/{job_id}", headers=headers).json()
        if until(video):
            return video
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} never got there: {video}")


def test_two_replicas_serve_forty_jobs_from_eight_clients_with_none_lost(fleet):
    http = fleet.http
    made: list[tuple[str, str]] = []  # (job id, replica that took it)
    lock = threading.Lock()

    def client(c: int) -> None:
        for j in range(5):
            r = http.post("/v1/videos", json={"prompt": f"client {c} job {j}", "seed": c * 10 + j, **QUICK})
            assert r.status_code == 200, r.text
            with lock:
                made.append((r.json()["id"], r.headers["x-fv-replica"]))

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(client, range(8)))
    assert len({job for job, _ in made}) == 40
    assert len({replica for _, replica in made}) == 2  # both replicas took jobs
    for job, _ in made:
        done = _wait(http, job, {}, lambda v: v["status"] != "queued" and v["status"] != "in_progress")
        assert done["status"] == "completed", done
        mp4 = http.get(f"/v1/videos/{job}/content")
        assert mp4.status_code == 200 and mp4.content[4:8] == b"ftyp" and len(mp4.content) > 1000
    listed = http.get("/v1/videos", params={"limit": 100}).json()["data"]
    assert {job for job, _ in made} <= {v["id"] for v in listed}


def test_a_job_is_read_and_downloaded_through_the_other_replica(fleet, sessions):
    http = fleet.http
    a, b = sessions
    made = http.post("/v1/videos", json={"prompt": "made on a", **QUICK}, headers=_on(sessions[a]))
    assert made.headers["x-fv-replica"] == a
    done = _wait(http, made.json()["id"], _on(sessions[b]), lambda v: v["status"] == "completed")
    assert done["id"] == made.json()["id"]
    content = http.get(f"/v1/videos/{done['id']}/content", headers=_on(sessions[b]))
    assert content.headers["x-fv-replica"] == b and content.content[4:8] == b"ftyp"


def _cancelled_on(http, session: str) -> float:
    metrics = http.get("/metrics", headers=_on(session)).text
    line = [x for x in metrics.splitlines() if x.startswith("fv_jobs_total{") and 'status="cancelled"' in x]
    return float(line[0].rsplit(" ", 1)[1]) if line else 0.0


@pytest.mark.parametrize("order", ["a->b", "b->a"])
def test_a_running_job_is_cancelled_through_the_other_replica(fleet, sessions, order):
    http = fleet.http
    owner, other = sessions if order == "a->b" else reversed(list(sessions))
    before = _cancelled_on(http, sessions[owner])
    made = http.post("/v1/videos", json={"prompt": "cancel me", **LONG}, headers=_on(sessions[owner]))
    assert made.status_code == 200, made.text
    job_id = made.json()["id"]
    seen = _wait(http, job_id, _on(sessions[other]), lambda v: v["status"] == "in_progress")
    assert seen["progress"] < 50  # still running on its owner
    gone = http.delete(f"/v1/videos/{job_id}", headers=_on(sessions[other]))
    assert gone.status_code == 200 and gone.headers["x-fv-replica"] == other
    assert http.get(f"/v1/videos/{job_id}", headers=_on(sessions[owner])).status_code == 404
    deadline = time.monotonic() + 3  # the owner stops it at a step boundary, long before its 200 steps
    while _cancelled_on(http, sessions[owner]) == before:
        assert time.monotonic() < deadline, "the owner replica never cancelled the deleted job"
        time.sleep(0.05)
    assert http.get("/health", headers=_on(sessions[owner])).json()["running"] == 0


def test_a_starting_replica_recovers_only_the_jobs_of_replicas_that_are_gone(fleet, sessions):
    http = fleet.http
    a = next(iter(sessions))
    live = http.post("/v1/videos", json={"prompt": "a live replica's job", **LONG}, headers=_on(sessions[a]))
    live_id = live.json()["id"]
    _wait(http, live_id, {}, lambda v: v["status"] == "in_progress")
    dead = JobStore(
        fleet.data, owner="replica-that-died", store=fleet.store
    )  # a replica that ran a job, then stopped
    dead_id = new_job_id()
    dead.create(dead_id, TINY, "32x32", "auto", "left running")
    dead.progress(dead_id, 30)
    dead.close()

    newcomer = JobStore(
        fleet.data, owner="replica-starting-now", store=fleet.store
    )  # what a new replica does on start
    try:
        assert newcomer.get(live_id).status == "in_progress"  # the live replica's job is untouched
        failed = newcomer.get(dead_id)
        assert failed.status == "failed" and failed.error.code == "server_restart"
    finally:
        newcomer.close()
    done = http.delete(f"/v1/videos/{live_id}")
    assert done.status_code == 200


def test_each_replica_reports_its_queue_depth_to_the_autoscaler(fleet, sessions):
    http, name = fleet.http, fleet.name
    handle = serve.get_deployment_handle(name, app_name=name)

    def depths() -> list[float]:
        return sorted({handle.record_autoscaling_stats.remote().result()[QUEUE_DEPTH] for _ in range(12)})

    deadline = time.monotonic() + 30
    while depths()[-1] != 0.0:  # earlier tests' deletes reach their owners at the next watch
        assert time.monotonic() < deadline, "the replicas never became idle"
        time.sleep(0.2)
    a = next(iter(sessions))
    jobs = [
        http.post("/v1/videos", json={"prompt": f"queued {i}", **LONG}, headers=_on(sessions[a])).json()["id"]
        for i in range(3)
    ]
    try:
        assert depths()[-1] == 3.0  # replica a holds the three jobs (and the handle reached it)
    finally:
        for job in jobs:
            http.delete(f"/v1/videos/{job}")


def test_a_weight_push_through_the_proxy_reaches_both_replicas(fleet, sessions):
    http = fleet.http
    live = fv_core.load(TINY, host=wan_host()).instance.component("transformer").state_dict()
    new = {k: v + 0.05 for k, v in live.items() if v.is_floating_point()}
    plan = WeightSyncPlan(components=["transformer"], version="fleet-step-1")
    synced = push_weights(str(http.base_url), plan, new)  # lands on either replica
    assert synced["versions"] == {"transformer": "fleet-step-1"}
    assert synced["replicas_behind"] == [] and synced["replica_errors"] == {}
    for replica, session in sessions.items():
        made = http.post("/v1/videos", json={"prompt": "after the push", **QUICK}, headers=_on(session))
        assert made.headers["x-fv-replica"] == replica
        _wait(http, made.json()["id"], {}, lambda v: v["status"] == "completed")
        provenance = (fleet.shared / "videos" / f"{made.json()['id']}.json").read_text()
        assert '"transformer": "fleet-step-1"' in provenance, replica


def _replica_processes() -> dict[str, tuple[int, str]]:
    """Serve replica unique id -> (pid, node id) of its actor."""
    found = {}
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["name"].startswith("SERVE_REPLICA::"):
            handle = ray.get_actor(actor["name"], namespace=actor["namespace"])
            where = handle.__ray_call__.remote(
                lambda _: (os.getpid(), ray.get_runtime_context().get_node_id())
            )
            found[actor["name"].rsplit("#", 1)[-1]] = ray.get(where, timeout=30)
    return found


def test_replicas_run_on_both_nodes_and_a_killed_ones_jobs_are_recovered_on_the_other(fleet, sessions):
    http = fleet.http
    replicas = _replica_processes()
    assert len({node for _, node in replicas.values()}) == 2  # one replica per node
    victim, survivor = sessions
    jobs = [
        http.post("/v1/videos", json={"prompt": f"on the victim {i}", "seed": i, **QUICK, "num_inference_steps": 40},
                  headers=_on(sessions[victim])).json()["id"]
        for i in range(6)
    ]  # fmt: skip  # 4 run (max_running), 2 wait in its queue
    _wait(http, jobs[0], _on(sessions[survivor]), lambda v: v["status"] == "in_progress")
    [pid] = [pid for uid, (pid, _) in replicas.items() if f"-{uid}-" in victim]  # its id names its actor
    os.kill(pid, signal.SIGKILL)  # the replica's process dies (its node lives; Serve starts another)
    ends = [
        _wait(http, j, _on(sessions[survivor]), lambda v: v["status"] in ("completed", "failed"), 90)
        for j in jobs
    ]
    for video in ends:  # none lost: completed (on the survivor or a replacement), or failed with the reason
        assert video["status"] == "completed" or video["error"]["code"] == "server_restart", video
    assert any(v["status"] == "completed" for v in ends[4:]), ends  # the victim's queued jobs ran elsewhere
    for video in ends:
        if video["status"] == "completed":
            content = http.get(f"/v1/videos/{video['id']}/content", headers=_on(sessions[survivor]))
            assert content.status_code == 200 and content.content[4:8] == b"ftyp"
