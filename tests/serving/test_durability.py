"""Restart survival: completed jobs and their mp4s outlive the process; in-flight jobs come back failed."""

from __future__ import annotations

import os
import signal
import time

import openai
import pytest

from fv_core import ConfigError
from fv_core.serving.jobs import JobStore, new_job_id
from tests.serving.support import SMALL, ServerThread, tiny_deploy

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_restart_keeps_completed_and_fails_interrupted(host, tmp_path):
    deploy = tiny_deploy(tmp_path)
    with ServerThread(deploy, host) as first:
        client = openai.OpenAI(base_url=f"{first.url}/v1", api_key="-", max_retries=0)
        done = client.videos.create_and_poll(prompt="a kept video", poll_interval_ms=20, **SMALL)
        mp4 = client.videos.download_content(done.id).read()

    # What a killed process leaves behind: rows still queued / in progress.
    store = JobStore(tmp_path)
    running, queued = new_job_id(), new_job_id()
    store.create(running, "wan2.1-t2v-tiny", "32x32", "auto", "killed mid-run")
    store.progress(running, 40)
    store.create(queued, "wan2.1-t2v-tiny", "32x32", "auto", "killed in queue")
    store.close()

    with ServerThread(deploy, host) as second:
        client = openai.OpenAI(base_url=f"{second.url}/v1", api_key="-", max_retries=0)
        kept = client.videos.retrieve(done.id)
        assert kept.status == "completed" and client.videos.download_content(done.id).read() == mp4
        for job_id, was in ((running, "in_progress"), (queued, "queued")):
            video = client.videos.retrieve(job_id)
            assert video.status == "failed" and video.error.code == "server_restart"
            assert was in video.error.message and "submit it again" in video.error.message
        assert second.service.store.recovered == 2


def test_shutdown_lets_jobs_finish_within_the_grace_period_then_fails_the_rest_with_reason(host, tmp_path):
    deploy = tiny_deploy(tmp_path)
    deploy.shutdown_grace_s = 60
    with ServerThread(deploy, host) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="-", max_retries=0)
        drained = client.videos.create(prompt="finished on the way out", **SMALL)
    store = JobStore(tmp_path)
    assert store.get(drained.id).status == "completed" and store.video_path(drained.id).stat().st_size > 1000
    store.close()


def test_queued_jobs_stay_queued_through_a_restart_and_run_with_the_same_request(host, tmp_path):
    deploy = tiny_deploy(tmp_path, max_running=1, max_steps=200)
    deploy.shutdown_grace_s = 0
    # long enough that the stop always finds it running (a loaded machine ran 100 32x32 steps before the stop)
    long = {"size": "64x64", "extra_body": {"num_frames": 9, "num_inference_steps": 200}}
    with ServerThread(deploy, host) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="-", max_retries=0)
        cut = client.videos.create(prompt="cut short", **long)
        waiting = client.videos.create(prompt="run after the restart", **SMALL)
        while client.videos.retrieve(cut.id).status != "in_progress":
            time.sleep(0.01)
    store = JobStore(tmp_path)
    job = store.get(cut.id)
    assert job.status == "failed" and job.error.code == "cancelled" and "engine stopped" in job.error.message
    assert store.get(waiting.id).status == "queued"
    store.close()

    deploy.shutdown_grace_s = 30
    with ServerThread(deploy, host) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="-", max_retries=0)
        done = client.videos.poll(waiting.id, poll_interval_ms=20)
        assert done.status == "completed" and done.prompt == "run after the restart"
        again = client.videos.create_and_poll(prompt="run after the restart", poll_interval_ms=20, **SMALL)
        same = [client.videos.download_content(v.id).read() for v in (done, again)]
        assert same[0] == same[1]  # the kept request: same params and seed


def test_a_second_server_on_the_same_data_dir_refuses_and_the_first_keeps_serving(host, tmp_path):
    deploy = tiny_deploy(tmp_path)
    with ServerThread(deploy, host) as first:
        client = openai.OpenAI(base_url=f"{first.url}/v1", api_key="-", max_retries=0)
        queued = client.videos.create(prompt="still mine", **SMALL)
        with pytest.raises(
            ConfigError, match=rf"data dir .* is in use by .*\"pid\": {os.getpid()}.*Fix: stop"
        ):
            JobStore(tmp_path)  # what a second `fv serve` on this data dir opens first
        done = client.videos.poll(queued.id, poll_interval_ms=20)
        assert done.status == "completed" and len(client.videos.download_content(done.id).read()) > 1000
    JobStore(tmp_path).close()  # the lock went with the first server


def test_the_default_data_dir_is_not_the_working_directory(monkeypatch, tmp_path):
    from fv_core.serving.jobs import default_data_dir

    monkeypatch.delenv("FV_DATA_DIR", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "share"))
    assert default_data_dir() == tmp_path / "share" / "fv"
    monkeypatch.setenv("FV_DATA_DIR", str(tmp_path / "mine"))
    assert default_data_dir() == tmp_path / "mine"


def test_served_jobs_report_when_they_expire(host, tmp_path):
    deploy = tiny_deploy(tmp_path)
    deploy.retention.max_age_s = 60
    with ServerThread(deploy, host) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="-", max_retries=0)
        done = client.videos.create_and_poll(prompt="short-lived", poll_interval_ms=20, **SMALL)
        assert done.expires_at == done.completed_at + 60


def test_sigterm_drains_new_jobs_503_running_ones_finish_and_stay_downloadable(host, tmp_path):
    deploy = tiny_deploy(tmp_path)
    deploy.shutdown_grace_s = 60
    srv = ServerThread(deploy, host).__enter__()
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="-", max_retries=0)
    running = client.videos.create(
        prompt="finishing", size="32x32", extra_body={"num_frames": 5, "num_inference_steps": 40, "seed": 1}
    )
    srv.server.handle_exit(signal.SIGTERM, None)  # what `fv serve` gets from SIGTERM or Ctrl-C
    deadline = time.monotonic() + 10
    while not srv.service.draining and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(openai.APIStatusError) as refused:
        client.videos.create(prompt="too late", **SMALL)
    assert refused.value.status_code == 503 and refused.value.response.headers["Retry-After"] == "60"
    assert "shutting down" in refused.value.message and "Fix" in refused.value.message
    assert client.videos.retrieve(running.id).status in ("queued", "in_progress")  # polls still answer
    srv.thread.join(timeout=60)
    assert not srv.thread.is_alive()  # it exits by itself once the running job is done
    store = JobStore(tmp_path)
    assert store.get(running.id).status == "completed" and store.video_path(running.id).stat().st_size > 1000
    store.close()


def test_a_data_dir_from_before_requeueing_opens_and_keeps_its_jobs(tmp_path):
    import sqlite3

    old = sqlite3.connect(tmp_path / "jobs.sqlite3")
    old.execute(
        "CREATE TABLE jobs (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, model TEXT NOT NULL, "
        "status TEXT NOT NULL, progress INTEGER NOT NULL DEFAULT 0, created_at INTEGER NOT NULL, "
        "completed_at INTEGER, size TEXT NOT NULL, seconds TEXT NOT NULL, prompt TEXT, error_code TEXT, "
        "error_message TEXT)"
    )
    job_id = new_job_id()
    old.execute(
        "INSERT INTO jobs (id, model, status, created_at, size, seconds) VALUES (?, 'm', 'queued', 1, '32x32', '1')",
        (job_id,),
    )
    old.commit()
    old.close()
    store = JobStore(tmp_path)
    assert store.get(job_id).error.code == "server_restart" and store.queued() == []
    store.close()
