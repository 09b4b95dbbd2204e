"""The job store in shared mode: two stores on one data dir in two processes (real SQLite, real flocks)."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from fv_core import ConfigError
from fv_core.serving.jobs import JobStore, new_job_id

MODEL = "wan2.1-t2v-tiny"
KEPT = {"raw": {"prompt": "again", "seed": 1}, "task": "t2v", "plugin_options": {}}


def _replica(root: str, job_id: str, started, stop) -> None:
    """Another replica: owns one running and one queued job, then lives until told to stop."""
    store = JobStore(root, owner="replica-a")
    store.create(job_id, MODEL, "32x32", "auto", "running on a")
    store.progress(job_id, 40)
    store.create(job_id[:-1] + "f", MODEL, "32x32", "auto", "queued on a", KEPT)
    started.set()
    stop.wait(60)
    if stop.is_set():
        store.close()


@pytest.fixture
def replica_a(tmp_path):
    """(data dir, running job id, process) of a live replica in another process."""
    ctx = mp.get_context("spawn")
    started, stop = ctx.Event(), ctx.Event()
    job_id = new_job_id()[:-1] + "0"
    proc = ctx.Process(target=_replica, args=(str(tmp_path), job_id, started, stop))
    proc.start()
    assert started.wait(60)
    yield tmp_path, job_id, proc
    if proc.is_alive():  # setting the event of a killed waiter would block on its semaphore for ever
        stop.set()
        proc.join(10)
    if proc.is_alive():
        proc.kill()


def test_a_second_replica_leaves_a_live_replicas_jobs_alone(replica_a):
    root, job_id, _ = replica_a
    b = JobStore(root, owner="replica-b")
    assert b.recovered == 0 and b.recover() == 0
    assert b.get(job_id).status == "in_progress"
    assert b.claim_queued([MODEL]) == []  # a's queued job stays a's


def test_a_lone_server_and_a_fleet_never_share_a_data_dir(replica_a, tmp_path):
    root, _, _ = replica_a
    with pytest.raises(ConfigError, match="in use by"):
        JobStore(root)
    lone = JobStore(tmp_path / "lone")
    with pytest.raises(ConfigError, match="in use by"):
        JobStore(tmp_path / "lone", owner="replica-b")
    lone.close()
    with pytest.raises(ConfigError, match="already in use"):
        JobStore(root, owner="replica-a")  # a's id is taken while a lives


def test_a_job_deleted_through_one_replica_is_missing_for_its_owner(replica_a):
    root, job_id, _ = replica_a
    b = JobStore(root, owner="replica-b")
    assert b.missing([job_id]) == []
    assert b.delete(job_id)
    assert JobStore(root, owner="replica-c").missing([job_id]) == [job_id]  # what a's watcher sees


def test_when_a_replica_dies_its_running_jobs_fail_and_its_queued_ones_are_claimed_once(replica_a):
    root, job_id, proc = replica_a
    b, c = JobStore(root, owner="replica-b"), JobStore(root, owner="replica-c")
    proc.kill()  # no clean close: the OS drops a's flock
    proc.join(10)
    assert b.recover() == 1
    failed = b.get(job_id)
    assert failed.status == "failed" and failed.error.code == "server_restart"
    assert c.recover() == 0  # idempotent
    assert c.claim_queued(["another-model"]) == []  # only models the replica serves
    claimed = b.claim_queued([MODEL]) + c.claim_queued([MODEL])
    assert [(m, r) for _, m, r in claimed] == [(MODEL, KEPT)]  # exactly one replica got it
