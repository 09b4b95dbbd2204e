"""Two "hosts" on one machine: two servers in two processes (one a subprocess, the one killed; the other
in the test's process) with their own data dirs that share only a PostgreSQL job store and an S3 bucket
(a real S3 server process). Jobs go through both; a delete through one
cancels the other's running job; one is killed mid-run: no job is lost, its queued jobs run on the
other, every finished job downloads through the other (from the bucket), and no job runs twice."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from fv_core.deploy.card import parse_deploy
from fv_core.serving.store import Database
from tests.serving.support import TINY, ServerThread, tiny_deploy

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
CLIENTS, JOBS = 4, 2  # per client, one through each host
# long enough that host a still has queued jobs when the test, polling, sees its first one done (on a loaded machine)
ASK = {"model": TINY, "size": "32x32", "extra_body": {"num_frames": 5, "num_inference_steps": 24}}


def _start(tmp_path, name: str, deploy: dict) -> tuple[subprocess.Popen, str]:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({**deploy, "data_dir": str(tmp_path / name)}))
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.serving.replica", str(path), name],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "FV_CACHE_DIR": str(tmp_path / "cache")},
    )
    line = proc.stdout.readline() if proc.stdout else ""
    assert line.startswith("port "), f"replica {name} did not start: {line!r}"
    return proc, f"http://127.0.0.1:{line.split()[1]}"


def _jobs_total(url: str, status: str) -> float:
    metrics = httpx.get(f"{url}/metrics").text
    found = re.search(rf'^fv_jobs_total{{model="{TINY}",status="{status}"}} (\S+)$', metrics, re.M)
    return float(found[1]) if found else 0.0


def completed_id(ends: dict) -> str:
    return next(job_id for job_id, video in ends.items() if video.status == "completed")


def test_two_hosts_share_postgres_and_s3_and_survive_one_killed(host, tmp_path, postgres, s3):
    url = postgres.database()
    deploy = tiny_deploy(tmp_path, max_running=1, max_steps=200).model_dump(mode="json")
    deploy.update(store=url, artifacts=f"s3://{s3.bucket}/two-hosts", shutdown_grace_s=0)
    a, a_url = _start(tmp_path, "host-a", deploy)  # a process of its own: the one killed
    own = parse_deploy({**deploy, "data_dir": str(tmp_path / "host-b")})
    with ServerThread(own, host, replica="host-b") as b_server:  # the other: in this process
        _run(a, a_url, b_server.url, url)


def _run(a: subprocess.Popen, a_url: str, b_url: str, url: str) -> None:
    try:
        clients = {u: openai.OpenAI(base_url=f"{u}/v1", api_key="-", max_retries=0) for u in (a_url, b_url)}
        on_a = clients[a_url].videos.create(prompt="deleted through b", **{**ASK, "extra_body": {
            "num_frames": 5, "num_inference_steps": 200}})  # fmt: skip
        while clients[b_url].videos.retrieve(on_a.id).status != "in_progress":
            time.sleep(0.02)
        assert clients[b_url].videos.delete(on_a.id).deleted
        deadline = time.monotonic() + 10
        while _jobs_total(a_url, "cancelled") < 1:  # a's watcher saw the row gone: cancelled at a step
            assert time.monotonic() < deadline, "host a never cancelled the job deleted through b"
            time.sleep(0.05)

        def submit(i: int) -> list[tuple[str, str]]:
            urls = (a_url, b_url)
            return [
                (urls[j % 2], clients[urls[j % 2]].videos.create(prompt=f"c{i} j{j}", **ASK).id)
                for j in range(JOBS)
            ]

        with ThreadPoolExecutor(CLIENTS) as pool:
            jobs = [job for batch in pool.map(submit, range(CLIENTS)) for job in batch]
        via_a = [job_id for u, job_id in jobs if u == a_url]
        while all(clients[b_url].videos.retrieve(j).status != "completed" for j in via_a):
            time.sleep(0.02)  # a is mid-run: one of its jobs done, others running or queued
        a.kill()
        a.wait(10)
        done_by_a = {j for j in via_a if clients[b_url].videos.retrieve(j).status == "completed"}

        b_client, ends = clients[b_url], {}
        deadline = time.monotonic() + 60
        for _, job_id in jobs:
            while (video := b_client.videos.retrieve(job_id)).status in ("queued", "in_progress"):
                assert time.monotonic() < deadline, f"{job_id} never finished: {video}"
                time.sleep(0.05)
            ends[job_id] = video
        for job_id, video in ends.items():  # none lost: each completed, or failed with the reason
            assert video.status == "completed" or video.error.code == "server_restart", video
            if video.status == "completed":  # from the bucket, through the host that lives
                mp4 = b_client.videos.download_content(job_id).read()
                assert len(mp4) > 1000
        answer = httpx.get(f"{b_url}/v1/videos/{completed_id(ends)}")
        link = answer.headers["x-fv-download-url"]
        assert answer.json()["download_url"] == link  # the job record carries the presigned link too
        assert httpx.get(link).content == b_client.videos.download_content(completed_id(ends)).read()
        db = Database(url)
        owners = dict(db.execute("SELECT id, owner FROM jobs").fetchall())
        db.close()
        taken_over = [j for j in via_a if owners[j] == "host-b" and ends[j].status == "completed"]
        assert taken_over, "host b ran none of host a's queued jobs"
        completed = [j for j, v in ends.items() if v.status == "completed"]
        assert set(completed) - done_by_a == {j for j in completed if owners[j] == "host-b"}
        assert _jobs_total(b_url, "completed") == len(completed) - len(
            done_by_a
        )  # b ran each of the rest once
    finally:
        a.kill()
        a.wait(10)


def test_weight_syncs_reach_the_other_host_through_the_bucket(host, tmp_path, postgres, s3):
    """Hosts with data dirs of their own: a push to one reaches the other, and one started later, as a
    payload in the bucket; the log's compaction deletes it from the bucket."""
    from fv_core.training import WeightSyncPlan, push_weights
    from tests.serving.test_fleet_weight_sync import assert_holds, same_weights, shifted

    deploy = tiny_deploy(tmp_path, max_running=1, max_steps=50).model_dump(mode="json")
    deploy.update(store=postgres.database(), artifacts=f"s3://{s3.bucket}/weights-test")

    def on(name: str):
        return parse_deploy({**deploy, "data_dir": str(tmp_path / name)})

    with ServerThread(on("a"), host, replica="a") as a, ServerThread(on("b"), host, replica="b") as b:
        first = shifted(a, 1, keep=4)
        assert (
            push_weights(a.url, WeightSyncPlan(components=["transformer"], version="step-1"), first)[
                "replicas_behind"
            ]
            == []
        )
        assert_holds(b, "step-1", first)
        [logged] = a.service._weights.after(0, [TINY])
        key, bucket = f"weights/{logged.path.name}", a.service.store.storage
        with ServerThread(on("c"), host, replica="c") as c:  # started later, on a data dir of its own
            assert_holds(c, "step-1", first)
            assert same_weights(c, a)
            assert (tmp_path / "c" / key).read_bytes() == bucket.read(key)  # c's copy, from the bucket
            every = shifted(b, 2)  # every tensor: the first push compacts away, in the bucket too
            push_weights(b.url, WeightSyncPlan(components=["transformer"], version="step-2"), every)
            for server in (a, b, c):
                assert_holds(server, "step-2", every)
            assert not bucket.exists(key)
