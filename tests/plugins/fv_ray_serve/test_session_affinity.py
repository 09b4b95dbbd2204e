"""Session affinity in the Ray Serve fleet: two replicas of the tiny causal card (on a one-node Ray cluster
of this process, jobs in the shared data dir's SQLite) behind the real Serve HTTP proxy, with fv's own
request router (``fv_ray_serve.affinity``).

A session's requests and its WebSocket, carrying ``x-session-id``, always reach the replica holding its KV
pages; one reaching another replica without the header is told where it lives (421); ``/v1/sessions`` on
any replica lists every session with its replica; a replica killed mid-stream closes its sockets (no
hang), and a reconnect gets an error event naming the gone replica while the other replica's session goes
on."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest
import ray
from ray import serve
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from fv_ray_serve import applications, split_fleet
from tests.serving.support import free_port

CAUSAL = "wan2.1-t2v-tiny-causal"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    env = {"FV_PLUGINS": "fv-wan", "FV_CACHE_DIR": str(tmp_path_factory.mktemp("fv-cache"))}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        deploy, scale = split_fleet(
            {
                "plugins": ["fv-wan"],
                "models": [{"card": CAUSAL}],
                "data_dir": str(tmp_path_factory.mktemp("fleet-data")),
                "shutdown_grace_s": 0,
                "fleet": {"models": {CAUSAL: {"replicas": 2, "ray_actor_options": {"num_cpus": 1}}}},
            }
        )  # fmt: skip
        [(name, app, prefix)] = applications(deploy, scale)
        serve.run(app, name=name, route_prefix=prefix)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
            yield http
        serve.shutdown()
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def placed(fleet):
    """{replica id: a real-time session it holds} for both replicas."""
    found: dict[str, str] = {}
    for _ in range(16):
        made = fleet.post("/v1/sessions", json={"fps": 8, "prompt": "a red circle", "linger_s": 120})
        assert made.status_code == 200, made.text
        sid, replica = made.json()["id"], made.json()["replica"]
        assert made.headers["x-fv-replica"] == replica
        if replica in found:
            assert fleet.delete(f"/v1/sessions/{sid}", headers={"x-session-id": sid}).status_code == 200
        found.setdefault(replica, sid)
        if len(found) == 2:
            return found
    raise AssertionError(f"sessions opened only on {sorted(found)}")


def socket(http: httpx.Client, sid: str):
    url = str(http.base_url).replace("http", "ws").rstrip("/") + f"/v1/sessions/{sid}/ws"
    return connect(url, additional_headers={"x-session-id": sid}, open_timeout=30)


def receive(ws) -> dict:
    return json.loads(ws.recv(timeout=60))


def test_a_sessions_requests_reach_its_replica_and_the_list_names_where_each_lives(fleet, placed):
    for replica, sid in placed.items():
        for _ in range(4):
            record = fleet.get(f"/v1/sessions/{sid}", headers={"x-session-id": sid})
            assert record.status_code == 200 and record.json()["replica"] == replica
    listed = {s["id"]: s for s in fleet.get("/v1/sessions").json()["data"]}
    for replica, sid in placed.items():
        assert (listed[sid]["replica"], listed[sid]["status"], listed[sid]["kind"]) == (
            replica,
            "open",
            "realtime",
        )
    sid = next(iter(placed.values()))
    for _ in range(30):  # without the header, two random choices reach the other replica soon
        if (stray := fleet.get(f"/v1/sessions/{sid}")).status_code == 421:
            break
    error = stray.json()["error"]
    assert error["code"] == "wrong_replica" and f"x-session-id: {sid}" in error["message"]


def _kill(replica: str) -> None:
    """SIGKILL the process of the Serve replica whose fv id is ``replica`` (it names the Serve id)."""
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["name"].startswith("SERVE_REPLICA::") and f"-{actor['name'].rsplit('#', 1)[-1]}-" in replica:
            handle = ray.get_actor(actor["name"], namespace=actor["namespace"])
            os.kill(ray.get(handle.__ray_call__.remote(lambda _: os.getpid()), timeout=30), signal.SIGKILL)
            return
    raise AssertionError(f"no Serve actor for {replica}")


def test_a_killed_replica_ends_its_sessions_with_an_error_and_the_others_go_on(fleet, placed):
    (victim, lost), (survivor, kept) = placed.items()
    with socket(fleet, lost) as ws:
        assert receive(ws)["type"] == "session"
        assert receive(ws)["type"] == "chunk"
        _kill(victim)
        deadline = time.monotonic() + 60
        with pytest.raises(ConnectionClosed):  # the proxy closes the socket: no hang
            while time.monotonic() < deadline:
                ws.recv(timeout=60)
    deadline = (
        time.monotonic() + 20
    )  # known gone once its process is reaped, at the latest when its lease ends
    while (listed := {s["id"]: s for s in fleet.get("/v1/sessions").json()["data"]})[lost][
        "status"
    ] == "open":
        assert time.monotonic() < deadline, listed
        time.sleep(0.2)
    assert (listed[lost]["status"], listed[lost]["replica"], listed[kept]["status"]) == (
        "lost",
        victim,
        "open",
    )
    with socket(fleet, lost) as ws:  # a reconnect: the error event names the gone replica
        message = receive(ws)
        assert (
            message["type"] == "error" and message["code"] == "session_lost" and victim in message["message"]
        )
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=30)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1011
    assert fleet.get(f"/v1/sessions/{lost}", headers={"x-session-id": lost}).status_code == 404  # forgotten
    with socket(fleet, kept) as ws:
        hello = receive(ws)
        assert hello["type"] == "session" and hello["replica"] == survivor
        assert receive(ws)["type"] == "chunk"
        ws.send(json.dumps({"type": "stop"}))
        while (message := receive(ws))["type"] != "end":
            pass
    assert kept not in {s["id"] for s in fleet.get("/v1/sessions").json()["data"]}
