"""A deploy file's scheduling section reaches the served engine: auto runs the jobs and /metrics shows its
policy, costs and decisions; a job whose predicted peak can never fit memory_budget_bytes fails with the
numbers and the fix, and the server goes on serving."""

from __future__ import annotations

import re
import time

import httpx
import openai
import pytest

from fv_core.deploy.card import Scheduling
from tests.serving.support import SMALL, TINY, ServerThread, tiny_deploy, wan_host

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the client marks Sora APIs deprecated


def settled(client: openai.OpenAI, video_id: str):
    deadline = time.monotonic() + 60
    while (video := client.videos.retrieve(video_id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, video
        time.sleep(0.02)
    return video


def metric(text: str, line: str) -> float:
    found = re.search(rf"^{re.escape(line)} (\S+)$", text, re.M)
    assert found, f"{line!r} not in /metrics"
    return float(found[1])


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("FV_CACHE_DIR", str(tmp_path_factory.mktemp("fv-cache")))
    yield wan_host()
    mp.undo()


def test_auto_serves_jobs_and_metrics_show_its_costs_and_decisions(host, tmp_path):
    deploy = tiny_deploy(tmp_path, determinism="batched")
    deploy.scheduling = Scheduling(policy="auto")
    with ServerThread(deploy, host) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0, timeout=60)
        ids = [client.videos.create(model=TINY, prompt=f"a red circle {i}", **SMALL).id for i in range(3)]
        assert [settled(client, i).status for i in ids] == ["completed"] * 3
        text = httpx.get(f"{server.url}/metrics").text
    assert metric(text, 'fv_scheduling_policy{policy="auto"}') == 1.0
    calls = metric(text, 'fv_schedule_decisions_total{decision="alone"}')
    calls += metric(text, 'fv_schedule_decisions_total{decision="batch"}')
    assert calls >= 3 * 2  # at least the 2 denoise steps of each job
    assert metric(text, "fv_step_cost_measured_seconds_total") > 0
    assert metric(text, "fv_step_cost_predicted_seconds_total") > 0


def test_a_job_that_can_never_fit_the_memory_budget_fails_with_the_numbers(host, tmp_path):
    deploy = tiny_deploy(tmp_path)
    deploy.scheduling = Scheduling(memory_budget_bytes=1000)
    with ServerThread(deploy, host) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0, timeout=60)
        video = settled(client, client.videos.create(model=TINY, prompt="a red circle", **SMALL).id)
        text = httpx.get(f"{server.url}/metrics").text
    assert video.status == "failed" and video.error.code == "admission_infeasible"
    assert re.search(
        r"predicted memory needs \d+ resident \+ \d+ peak = \d+ bytes but the memory budget is 1000 bytes, "
        r"so it can never run\. Fix: .*scheduling\.memory_budget_bytes",
        video.error.message,
    ), video.error.message
    assert metric(text, 'fv_admission_refusals_total{reason="infeasible"}') == 1.0
