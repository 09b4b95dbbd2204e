"""Weight sync across a fleet: replicas on one shared data dir (real servers, real SQLite log and files).

A trainer pushes to whichever replica the proxy picks; every replica applies every push in the
log's order (two pushes at once through two replicas included), a replica that starts later comes
up on the fleet's weights, a version synced before is refused, and a push whose tensors later
pushes replace all over is compacted out of the log.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from fv_core import ConfigError
from fv_core.serving.jobs import JobStore
from fv_core.serving.weight_log import LoggedSync, WeightLog, tensor_names
from fv_core.training import WeightSyncPlan, push_weights
from fv_core.training.sync import encode
from tests.serving.support import TINY, ServerThread, tiny_deploy

ASK = {
    "prompt": "a red circle moving left",
    "seed": 3,
    "size": "32x32",
    "num_frames": 5,
    "num_inference_steps": 2,
}


def transformer(server: ServerThread) -> torch.nn.Module:
    return server.service.models[TINY].loaded.instance.component("transformer")


def shifted(server: ServerThread, seed: int, keep: int | None = None) -> dict[str, torch.Tensor]:
    """The live transformer's float tensors (the first ``keep`` of them), moved by seeded noise."""
    gen = torch.Generator().manual_seed(seed)
    live = [(k, v) for k, v in transformer(server).state_dict().items() if v.is_floating_point()]
    return {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in live[:keep]}


def assert_holds(server: ServerThread, version: str, weights: dict[str, torch.Tensor]) -> None:
    assert server.service.models[TINY].loaded.instance.weights_versions["transformer"] == version
    state = transformer(server).state_dict()
    assert all(torch.equal(state[k], v) for k, v in weights.items())


def provenance_version(server: ServerThread) -> str:
    """Run one job on ``server``; the transformer version its provenance records."""
    job, deadline = httpx.post(f"{server.url}/v1/videos", json=ASK).json()["id"], time.monotonic() + 60
    while (video := httpx.get(f"{server.url}/v1/videos/{job}").json())["status"] != "completed":
        assert video["status"] in ("queued", "in_progress") and time.monotonic() < deadline, video
        time.sleep(0.02)
    provenance = server.service.store.video_path(job).with_suffix(".json").read_text()
    return provenance.split('"transformer": "', 1)[1].split('"', 1)[0]


@pytest.fixture
def deploy(tmp_path):
    return tiny_deploy(tmp_path / "data", max_frames=9, max_steps=50, max_queue=8, max_running=2)


def test_a_push_to_one_replica_reaches_every_replica_and_those_started_later(host, deploy):
    log = Path(deploy.data_dir) / "weights"
    with ServerThread(deploy, host, replica="a") as a, ServerThread(deploy, host, replica="b") as b:
        base = a.service.models[TINY].loaded.instance.weights_versions["transformer"]
        first = shifted(a, 1)
        synced = push_weights(a.url, WeightSyncPlan(components=["transformer"], version="step-1"), first)
        assert synced["versions"] == {"transformer": "step-1"}
        assert synced["fleet_seq"] == 1 and synced["replicas_behind"] == [] and synced["replica_errors"] == {}
        assert_holds(b, "step-1", first)  # b applied it before a answered
        assert provenance_version(b) == "step-1"

        second = shifted(b, 2, keep=3)  # a partial push, through the other replica
        synced = push_weights(b.url, WeightSyncPlan(components=["transformer"], version="step-2"), second)
        assert synced["fleet_seq"] == 2 and synced["replicas_behind"] == []
        assert_holds(a, "step-2", {**first, **second})

        for version in ("step-2", "step-1", base):  # live, synced before, loaded: refused, changing nothing
            with pytest.raises(ConfigError, match="HTTP 409"):
                push_weights(a.url, WeightSyncPlan(components=["transformer"], version=version), first)
        rows = a.service._weights.after(0, [TINY])
        assert [r.seq for r in rows] == [1, 2]  # step-2 replaces only 3 tensors: step-1 stays

        with ServerThread(deploy, host, replica="c") as c:  # a replica started after the pushes
            assert_holds(c, "step-2", {**first, **second})
            assert same_weights(c, a)

            pushes = [(a, shifted(a, 4, keep=5), "step-3a"), (b, shifted(b, 5, keep=4), "step-3b")]
            with ThreadPoolExecutor(2) as pool:  # at once, through two replicas, over the same tensors
                answers = list(pool.map(lambda p: push_weights(p[0].url, plan(p[2]), p[1]), pushes))
            assert sorted(x["fleet_seq"] for x in answers) == [3, 4]
            last = max(answers, key=lambda x: x["fleet_seq"])["versions"]["transformer"]
            for server in (a, b, c):  # one order everywhere: the same weights on every replica
                assert server.service.models[TINY].loaded.instance.weights_versions["transformer"] == last
                assert same_weights(server, a)

            full = shifted(c, 6)  # every tensor: the earlier pushes compact away
            synced = push_weights(c.url, plan("step-4"), full)
            assert synced["fleet_seq"] == 5 and synced["replicas_behind"] == []
            [kept] = a.service._weights.after(0, [TINY])
            assert kept.seq == 5 and [p.name for p in log.glob("*.safetensors")] == [kept.path.name]
            for server in (a, b, c):
                assert_holds(server, "step-4", full)


def plan(version: str) -> WeightSyncPlan:
    return WeightSyncPlan(components=["transformer"], version=version)


def same_weights(one: ServerThread, other: ServerThread) -> bool:
    a, b = transformer(one).state_dict(), transformer(other).state_dict()
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_push_whose_caller_goes_away_midway_still_lands_on_every_replica(host, deploy):
    with ServerThread(deploy, host, replica="a") as a, ServerThread(deploy, host, replica="b") as b:
        engine, gate = a.service.engine, threading.Event()
        engine.at_boundary(lambda _: gate.wait(60))  # a's worker parks: the push's swap queues behind it
        weights = encode(plan("step-1"), shifted(a, 1))
        push = asyncio.run_coroutine_threadsafe(
            a.service.sync_weights(None, plan("step-1").model_dump_json(), weights), engine._event_loop
        )
        deadline = time.monotonic() + 30
        while not a.service._weights.db.execute("SELECT 1 FROM weight_syncs").fetchone():
            assert time.monotonic() < deadline, "the push never logged its sync"
            time.sleep(0.01)
        push.cancel()  # the caller goes away while the swap waits for a step boundary
        gate.set()
        deadline = time.monotonic() + 30
        while b.service._weights_seq < 1:
            assert time.monotonic() < deadline, "the other replica never got the push"
            time.sleep(0.02)
        for server in (a, b):  # the swap finished, the sync settled and reached the other replica
            assert server.service.models[TINY].loaded.instance.weights_versions["transformer"] == "step-1"
        assert same_weights(a, b)


def test_the_log_serves_settled_syncs_in_order_and_compacts_what_all_replicas_applied(tmp_path):
    store, other = JobStore(tmp_path, owner="replica-a"), JobStore(tmp_path, owner="replica-b")
    log, log_b = WeightLog(store), WeightLog(other)

    def publish(*names: str) -> LoggedSync:
        payload = encode_names(names)
        return log.publish(TINY, "{}", log.write(payload), tensor_names(payload))

    first = publish("a", "b")
    assert log.after(0, [TINY]) == []  # pending: its receiver has not put it live yet
    log.settle(first, {"transformer": "v1"})
    failed = publish("a", "b")
    log.withdraw(failed)  # it failed on its receiver: no replica applies it
    assert [s.seq for s in log.after(0, [TINY])] == [first.seq] and not failed.path.exists()
    dead = publish("a")  # a receiver that died before settling: the next push drops it
    partial = publish("a")
    assert not dead.path.exists()
    log.settle(partial, {"transformer": "v2"})
    full = publish("a", "b", "c")
    log.settle(full, {"transformer": "v3"})
    assert [s.seq for s in log.after(0, [TINY])] == [first.seq, partial.seq, full.seq]
    assert log.after(first.seq, [TINY])[0].seq == partial.seq and log.after(0, ["other"]) == []

    log.applied(TINY, full.seq)
    log_b.applied(TINY, partial.seq)  # b has not applied the full one: it needs the first still
    log.compact(TINY)
    assert [s.seq for s in log.after(0, [TINY])] == [first.seq, partial.seq, full.seq]
    log_b.applied(TINY, full.seq)
    log.compact(TINY)
    assert [s.seq for s in log.after(0, [TINY])] == [full.seq]
    assert not first.path.exists() and not partial.path.exists() and full.path.exists()
    for version in ("v1", "v2", "v3"):  # compacted or not, a version is never taken again
        with pytest.raises(ConfigError, match=f"version '{version}' of 'transformer' was synced"):
            log.check_new(TINY, ["transformer"], version)
    log.check_new(TINY, ["transformer"], "v4")

    assert log.behind(TINY, full.seq) == [] and log.behind(TINY, full.seq + 1) == ["replica-a", "replica-b"]
    log_b.failed(dataclasses.replace(full, seq=full.seq + 1), "OutOfMemoryError: ...")
    assert log.failures(TINY, full.seq + 1) == {"replica-b": "OutOfMemoryError: ..."}
    assert log.failures("another-model", full.seq + 1) == {}
    log_b.applied(TINY, full.seq + 1)  # it got past: the error goes
    assert log.failures(TINY, full.seq + 1) == {}
    log_b.failed(dataclasses.replace(full, seq=full.seq + 2), "OutOfMemoryError: ...")
    other.close()
    assert log.behind(TINY, full.seq + 2) == ["replica-a"]  # a stopped replica is not waited for
    assert log.failures(TINY, full.seq + 2) == {}  # nor reported
    store.close()


def encode_names(names: tuple[str, ...]) -> bytes:
    from safetensors.torch import save

    return save({f"transformer.{n}": torch.zeros(1) for n in names})
