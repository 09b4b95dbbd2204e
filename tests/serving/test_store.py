"""The job store on both databases (SQLite in the data dir, a real PostgreSQL): recovery after a crash,
leases (a replica that misses its heartbeats is taken for gone and fenced), claims exactly once, deletes
seen by the owner, retention, kept uploads, schema migrations."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time

import pytest

from fv_core import ConfigError
from fv_core.serving.jobs import JobStore, new_job_id
from fv_core.serving.store import VERSION, Database

MODEL = "wan2.1-t2v-tiny"
KEPT = {"raw": {"prompt": "again", "seed": 1}, "task": "t2v", "plugin_options": {}}


def _replica(root: str, url: str | None, ids: tuple[str, str], started, stop) -> None:
    """Another replica: owns one running and one queued job, then lives until told to stop (or is killed)."""
    store = JobStore(root, owner="replica-a", store=url)
    store.create(ids[0], MODEL, "32x32", "auto", "running on a")
    store.progress(ids[0], 40)
    store.create(ids[1], MODEL, "32x32", "auto", "queued on a", KEPT, upload=b"\x89PNG kept")
    started.set()
    stop.wait(60)
    if stop.is_set():
        store.close()


@pytest.fixture
def replica_a(tmp_path, store_url):
    """(data dir, store URL, (running id, queued id), process) of a live replica in another process."""
    ctx = mp.get_context("spawn")
    started, stop = ctx.Event(), ctx.Event()
    ids = (new_job_id(), new_job_id())
    proc = ctx.Process(target=_replica, args=(str(tmp_path), store_url, ids, started, stop))
    proc.start()
    assert started.wait(60)
    yield tmp_path, store_url, ids, proc
    if proc.is_alive():  # setting the event of a killed waiter would block on its semaphore for ever
        stop.set()
        proc.join(10)
    if proc.is_alive():
        proc.kill()


def test_a_live_replicas_jobs_are_left_alone_and_a_killed_ones_recovered_once(replica_a):
    root, url, (running, queued), proc = replica_a
    b, c = JobStore(root, owner="replica-b", store=url), JobStore(root, owner="replica-c", store=url)
    assert b.recovered == 0 and b.recover() == 0 and b.claim_queued([MODEL]) == []  # a's stay a's
    assert b.get(running).status == "in_progress"
    with pytest.raises(ConfigError, match="already in use"):
        JobStore(root, owner="replica-a", store=url)  # a's id is taken while a lives
    with pytest.raises(ConfigError, match=r"in use by a fleet of replicas.*Fix"):
        JobStore(root, store=url)  # a lone server never joins a fleet's store

    proc.kill()  # no clean close: its lease stays behind, its process is dead
    proc.join(10)
    assert b.recover() == 1
    failed = b.get(running)
    assert failed.status == "failed" and failed.error.code == "server_restart"
    assert c.recover() == 0  # idempotent
    assert c.claim_queued(["another-model"]) == []  # only models the replica serves
    claimed = b.claim_queued([MODEL]) + c.claim_queued([MODEL])
    assert claimed == [(queued, MODEL, KEPT)]  # exactly one replica got it
    owner = b if b.lost([queued]) == [] else c
    assert owner.upload(queued) == b"\x89PNG kept"  # its upload survived the crash with it
    b.close(), c.close()


def test_a_replica_that_misses_its_lease_is_recovered_and_fenced(tmp_path, store_url):
    hung = JobStore(tmp_path, owner="hung", store=store_url, lease_s=0.6)
    live = JobStore(tmp_path, owner="live", store=store_url, lease_s=0.6)
    running, queued = new_job_id(), new_job_id()
    hung.create(running, MODEL, "32x32", "auto", "mid-run")
    hung.progress(running, 10)
    hung.create(queued, MODEL, "32x32", "auto", "waiting", KEPT)
    assert live.recover() == 0
    hung.lease._stop.set()  # its heartbeats stop (a hung process, a network partition); its pid lives
    hung.lease._thread.join()
    time.sleep(0.8)  # past its expiry, in the database's clock
    assert live.recover() == 1 and live.get(running).error.code == "server_restart"
    assert [c[0] for c in live.claim_queued([MODEL])] == [queued]
    hung.progress(queued, 50)  # the hung replica wakes up: its writes no longer touch taken-over jobs
    assert not hung.complete(queued, "32x32", "1") and live.get(queued).status == "queued"
    assert sorted(hung.lost([running, queued])) == sorted([running, queued])  # its watcher cancels them
    live.close(), hung.close()


def test_concurrent_claims_hand_each_job_to_exactly_one_replica(tmp_path, store_url):
    stores = [JobStore(tmp_path, owner=f"r{i}", store=store_url) for i in range(4)]
    dead = JobStore(tmp_path, owner="dead", store=store_url)
    ids = [new_job_id() for _ in range(40)]
    for job_id in ids:
        dead.create(job_id, MODEL, "32x32", "auto", "orphan", KEPT)
    dead.lease._stop.set()
    dead.lease._thread.join()
    dead.db.execute("DELETE FROM leases WHERE owner='dead'")  # its lease ran out
    claimed: list[list[str]] = [[] for _ in stores]
    errors: list[BaseException] = []
    done = threading.Barrier(len(stores), timeout=60)

    def claim(i: int) -> None:
        store = JobStore(tmp_path, owner=f"r{i}-claimer", store=store_url)  # its own connection
        try:
            for _ in range(5):
                store.recover()
                claimed[i] += [c[0] for c in store.claim_queued([MODEL])]
        except BaseException as exc:  # reported below; the others must not wait for this one
            errors.append(exc)
            done.abort()
        try:
            done.wait()  # a store that closes hands its queued jobs back: all stay until all claimed
        except threading.BrokenBarrierError:
            pass
        store.close()

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(len(stores))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    together = [j for c in claimed for j in c]
    assert sorted(together) == sorted(ids)  # every job claimed, none twice
    for s in stores:
        s.close()


def test_a_job_deleted_through_one_replica_is_lost_to_its_owner(tmp_path, store_url):
    a = JobStore(tmp_path, owner="a", store=store_url)
    b = JobStore(tmp_path, owner="b", store=store_url)
    job_id = new_job_id()
    a.create(job_id, MODEL, "32x32", "auto", "deleted elsewhere", KEPT, upload=b"img")
    assert a.lost([job_id]) == []
    assert b.delete(job_id) and b.get(job_id) is None and a.upload(job_id) is None
    assert a.lost([job_id]) == [job_id]  # what a's watcher sees: it cancels the job at the next step
    a.close(), b.close()


def test_a_folder_backend_gives_no_download_url(tmp_path):
    store = JobStore(tmp_path)
    job_id = _finished_job(store, 10, completed_at=1_000)
    assert store.get(job_id).download_url is None and store.artifact(job_id) is not None
    store.close()


def _finished_job(store: JobStore, mp4_bytes: int, completed_at: int) -> str:
    job_id = new_job_id()
    store.create(job_id, MODEL, "32x32", "auto", "kept a while")
    store.video_path(job_id).write_bytes(b"\0" * mp4_bytes)
    store.video_path(job_id).with_suffix(".json").write_text("{}")
    assert store.complete(job_id, "32x32", "1")
    store.db.execute("UPDATE jobs SET completed_at=? WHERE id=?", (completed_at, job_id))
    return job_id


def test_retention_expires_old_jobs_and_keeps_the_artifacts_under_their_cap(tmp_path, store_url):
    store = JobStore(tmp_path, max_age_s=3600, store=store_url)
    old = _finished_job(store, 100, completed_at=1_000)
    middle = _finished_job(store, 100, completed_at=5_000)
    new = _finished_job(store, 100, completed_at=6_000)
    running = new_job_id()
    store.create(running, MODEL, "32x32", "auto", "never swept")
    assert store.get(new).expires_at == 6_000 + 3600

    assert store.sweep(now=4_600) == [old]  # 1000 + 3600 <= 4600; the others have time left
    assert store.get(old) is None and not store.video_path(old).exists()
    assert not store.video_path(old).with_suffix(".json").exists()

    assert store.sweep(max_bytes=150, now=4_600) == [middle]  # over the cap (102 bytes each): oldest first
    assert store.get(new).status == "completed" and store.artifact(new) == f"videos/{new}.mp4"
    assert store.sweep(max_bytes=0, now=10**9) == [new]
    assert store.get(running).status == "queued"  # unfinished work is never swept
    store.close()


def test_a_crashed_lone_servers_jobs_recover_on_restart_and_a_live_one_refuses_a_second(tmp_path, store_url):
    first = JobStore(tmp_path, store=store_url)
    running, queued, bare = new_job_id(), new_job_id(), new_job_id()
    first.create(running, MODEL, "32x32", "auto", "killed mid-run")
    first.progress(running, 40)
    first.create(queued, MODEL, "32x32", "auto", "kept", KEPT, "req-1")
    first.create(bare, MODEL, "32x32", "auto", "killed in queue")
    with pytest.raises(ConfigError, match=r"is in use by .*\"pid\".*Fix: stop"):
        JobStore(tmp_path, store=store_url)
    first.lease.release()  # what a crash leaves: rows in progress (its lease gone with its process)
    second = JobStore(tmp_path, store=store_url)
    assert second.recovered == 2 and second.request_id(queued) == "req-1"
    for job_id, was in ((running, "in_progress"), (bare, "queued")):
        error = second.get(job_id).error
        assert error.code == "server_restart" and was in error.message and "submit it again" in error.message
    assert second.claim_queued([]) == [(queued, MODEL, KEPT)]  # a lone server runs every kept job
    second.close()


def test_schema_versions_upgrade_an_old_database_and_refuse_a_newer_one(tmp_path, store_url):
    url = store_url or f"sqlite://{tmp_path / 'jobs.sqlite3'}"
    store = JobStore(tmp_path, store=store_url)
    assert store.migrated_from == 0
    job_id = new_job_id()
    store.create(job_id, MODEL, "32x32", "auto", "kept through versions", KEPT)
    store.close()
    db = Database(url)
    db.execute("DROP TABLE leases"), db.execute("DROP TABLE locks"), db.execute("DROP TABLE uploads")
    db.execute("DROP INDEX jobs_status"), db.execute("ALTER TABLE jobs DROP COLUMN bytes")
    db.execute("UPDATE schema_version SET version=1")  # a version-1 database
    db.close()
    store = JobStore(tmp_path, store=store_url)
    assert store.migrated_from == 1 and store.claim_queued([]) == [(job_id, MODEL, KEPT)]
    store.close()
    db = Database(url)
    db.execute("UPDATE schema_version SET version=?", (VERSION + 1,))
    db.close()
    with pytest.raises(
        ConfigError, match=rf"schema version {VERSION + 1}, newer than this fv's {VERSION}.*Fix: upgrade fv"
    ):
        JobStore(tmp_path, store=store_url)


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("store", "mysql://db/fv", "postgresql://user:password@host:port/database"),
        ("artifacts", "gs://bucket", "s3://bucket/prefix"),
        ("artifacts", "s3://", "file:///a/path/every/node/mounts"),
    ],
)
def test_bad_store_and_artifact_urls_name_the_field_the_value_and_the_fix(field, value, says):
    from fv_core.deploy.card import parse_deploy

    with pytest.raises(ConfigError, match="Fix") as err:
        parse_deploy({"models": [{"card": MODEL}], field: value}, "deploy.yaml")
    assert f"{field}:" in str(err.value) and repr(value) in str(err.value) and says in str(err.value)


def test_artifacts_in_an_s3_bucket_upload_on_completion_link_and_go_with_retention(tmp_path, s3):
    import httpx

    store = JobStore(tmp_path, max_age_s=60, artifacts=f"s3://{s3.bucket}/store-test")
    job_id = _finished_job(store, 3000, completed_at=1_000)
    key = store.artifact(job_id)
    assert key == f"videos/{job_id}.mp4" and not store.video_path(job_id).exists()  # uploaded, not kept here
    assert b"".join(store.storage.chunks(key)) == b"\0" * 3000
    link = store.get(job_id).download_url  # the presigned link, in the job record
    assert httpx.get(link).content == b"\0" * 3000  # straight from the bucket
    assert store.sweep(now=2_000) == [job_id]
    assert not store.storage.exists(key) and not store.storage.exists(f"videos/{job_id}.json")
    store.close()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_slow_bucket_stalls_no_other_request_and_a_job_carries_its_download_url(host, tmp_path, s3):
    """A job's upload hangs on the bucket: /health, retrievals and another whole job still answer."""
    import httpx
    import openai

    from fv_core.deploy.card import parse_deploy
    from tests.serving.support import SMALL, ServerThread, tiny_deploy

    deploy = tiny_deploy(tmp_path, max_running=2, max_steps=50).model_dump(mode="json")
    deploy["artifacts"] = f"s3://{s3.bucket}/slow"
    with ServerThread(parse_deploy(deploy), host) as server:
        storage, uploading, release = server.service.store.storage, threading.Event(), threading.Event()
        put, calls = storage.put, []

        def slow_put(key: str) -> int:  # the first job's upload waits until the test lets it go
            calls.append(key)
            if calls[0].split(".")[0] == key.split(".")[0]:
                uploading.set()
                assert release.wait(60)
            return put(key)

        storage.put = slow_put
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0, timeout=10)
        slow = client.videos.create(prompt="a slow upload", model=MODEL, **SMALL)
        try:
            assert uploading.wait(60)
            assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
            other = client.videos.create(prompt="meanwhile", model=MODEL, **SMALL)
            while (done := client.videos.retrieve(other.id)).status != "completed":
                assert done.status in ("queued", "in_progress"), done
                time.sleep(0.05)
            assert client.videos.retrieve(slow.id).status == "in_progress"  # still uploading
        finally:
            release.set()
        while client.videos.retrieve(slow.id).status != "completed":
            time.sleep(0.05)
        answer = httpx.get(f"{server.url}/v1/videos/{slow.id}")
        link = answer.json()["download_url"]
        assert link is not None and answer.headers["x-fv-download-url"] == link
        assert httpx.get(link).content == client.videos.download_content(slow.id).read()
