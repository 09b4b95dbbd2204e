"""Weight sync across a fleet: replicas on one shared data dir (real servers, real SQLite log and files).

A trainer pushes to whichever replica the proxy picks; every replica applies every push in the
log's order, a replica that starts later comes up on the fleet's weights, and a push whose
tensors later pushes replace all over is compacted out of the log.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
import torch

from fv_core import ConfigError
from fv_core.serving.jobs import JobStore
from fv_core.serving.weight_log import LoggedSync, WeightLog
from fv_core.training import WeightSyncPlan, push_weights
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
    job = httpx.post(f"{server.url}/v1/videos", json=ASK).json()["id"]
    while httpx.get(f"{server.url}/v1/videos/{job}").json()["status"] != "completed":
        time.sleep(0.02)
    provenance = server.service.store.video_path(job).with_suffix(".json").read_text()
    return provenance.split('"transformer": "', 1)[1].split('"', 1)[0]


@pytest.fixture
def deploy(tmp_path):
    return tiny_deploy(tmp_path / "data", max_frames=9, max_steps=50, max_queue=8, max_running=2)


def test_a_push_to_one_replica_reaches_every_replica_and_those_started_later(host, deploy):
    log = Path(deploy.data_dir) / "weights"
    with ServerThread(deploy, host, replica="a") as a, ServerThread(deploy, host, replica="b") as b:
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

        with pytest.raises(ConfigError, match="HTTP 409"):  # a clash changes nothing and logs nothing
            push_weights(a.url, WeightSyncPlan(components=["transformer"], version="step-2"), first)
        rows = a.service._weights.after(0, [TINY])
        assert [r.seq for r in rows] == [1, 2]  # step-2 replaces only 3 tensors: step-1 stays

        with ServerThread(deploy, host, replica="c") as c:  # a replica started after the pushes
            assert_holds(c, "step-2", {**first, **second})
            assert torch.equal(
                torch.cat([p.flatten() for p in transformer(c).parameters()]),
                torch.cat([p.flatten() for p in transformer(a).parameters()]),
            )
            third = shifted(c, 3)  # every tensor: the two earlier pushes compact away
            synced = push_weights(c.url, WeightSyncPlan(components=["transformer"], version="step-3"), third)
            assert synced["fleet_seq"] == 3 and synced["replicas_behind"] == []
            [kept] = a.service._weights.after(0, [TINY])
            assert kept.seq == 3 and [p.name for p in log.iterdir()] == [kept.path.name]
            for server in (a, b, c):
                assert_holds(server, "step-3", third)


def test_a_failed_sync_is_withdrawn_and_only_settled_syncs_replace_earlier_ones(tmp_path):
    store = JobStore(tmp_path, owner="replica-a")
    log = WeightLog(store)

    def publish(*names: str) -> LoggedSync:
        seq = log.publish(TINY, "{}", b"payload", {"transformer": list(names)})
        return next(s for s in log.after(seq - 1, [TINY]) if s.seq == seq)

    first = publish("a", "b")
    log.settle(first, ok=True)
    clash = publish("a", "b")  # not settled yet: replaces nothing
    assert [s.seq for s in log.after(0, [TINY])] == [first.seq, clash.seq] and log.after(0, ["other"]) == []
    log.settle(clash, ok=False)  # it failed on its receiver: it would fail on every replica
    assert [s.seq for s in log.after(0, [TINY])] == [first.seq] and not clash.path.exists()
    partial = publish("a")
    log.settle(partial, ok=True)
    assert [s.seq for s in log.after(0, [TINY])] == [first.seq, partial.seq]  # "b" is only in the first
    full = publish("a", "b", "c")
    log.settle(full, ok=True)
    assert [s.seq for s in log.after(0, [TINY])] == [full.seq]
    assert not first.path.exists() and not partial.path.exists() and full.path.exists()

    log.applied(TINY, full.seq)
    assert log.behind(TINY, full.seq) == [] and log.behind(TINY, full.seq + 1) == ["replica-a"]
    log.applied(TINY, full.seq + 1, "shape mismatch")
    assert log.failures(TINY, full.seq + 1) == {"replica-a": "shape mismatch"}
    store.close()
