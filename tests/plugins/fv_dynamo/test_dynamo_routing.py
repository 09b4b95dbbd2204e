"""Routing fv work behind Dynamo: ``CostRouter`` sends requests to the worker whose calibrated cost model
predicts the least queued work (two real workers, one held busy); workflow ids are served through Dynamo's
frontend; ``frontend_body`` keeps exactly what Dynamo's frontend carries to a worker."""

from __future__ import annotations

import asyncio
import base64
import time

import pytest

pytest.importorskip(
    "dynamo.runtime",
    reason="ai-dynamo is not installed (wheels: Linux x86_64 / aarch64). Fix: pip install -r requirements-dev.txt",
)
from dynamo.runtime import DistributedRuntime  # noqa: E402

from fv_core import ConfigError  # noqa: E402
from fv_dynamo import CostRouter, frontend_body  # noqa: E402
from tests.plugins.fv_dynamo.conftest import WORKFLOW  # noqa: E402
from tests.serving.support import TINY  # noqa: E402

SHORT = {"model": TINY, "prompt": "a quick fox", "size": "32x32", "response_format": "url",
         "nvext": {"num_frames": 5, "num_inference_steps": 2}}  # fmt: skip
LONG = {
    "model": TINY,
    "prompt": "a slow fox",
    "size": "160x160",
    "num_frames": 41,
    "num_inference_steps": 100,
}


def _job_id(answer: dict) -> str:
    assert answer["status"] == "completed", answer
    return answer["id"]


async def _route(dynamo) -> dict:
    runtime = DistributedRuntime(asyncio.get_running_loop(), "etcd", "nats")
    try:
        router = await CostRouter.connect(runtime, dynamo.namespace, TINY)
        before = await router.loads()
        held = dynamo.worker.post("/v1/videos", json=LONG)  # worker 1 holds a long job
        assert held.status_code == 200, held.text
        busy = held.json()["id"]
        deadline = time.monotonic() + 30
        while dynamo.worker.get(f"/v1/videos/{busy}").json()["status"] != "in_progress":
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        loads = await router.loads()
        picked = await router.pick()

        async def one() -> str:
            return _job_id([a async for a in router.send(SHORT)][-1])

        jobs = await asyncio.gather(*(one() for _ in range(4)))  # at once: one pick at a time
        dynamo.worker.delete(f"/v1/videos/{busy}")
        return {"before": before, "loads": loads, "picked": picked, "jobs": jobs}
    finally:
        runtime.shutdown()


def test_the_cost_router_sends_work_where_the_least_predicted_seconds_are_queued(dynamo, monkeypatch):
    for name, value in dynamo.env.items():
        monkeypatch.setenv(name, value)
    seen = asyncio.run(_route(dynamo))
    assert len(seen["loads"]) == 2 and all(load["queued_s"] == 0 for load in seen["before"].values())
    busy, idle = sorted(seen["loads"], key=lambda i: seen["loads"][i]["queued_s"], reverse=True)
    assert seen["loads"][busy]["queued_s"] > 1.0 and seen["loads"][busy]["requests"] == 1  # the long job
    assert seen["loads"][idle]["queued_s"] == 0 and seen["picked"] == idle
    for job in seen["jobs"]:  # every short job ran on the idle worker, none behind the long one
        assert dynamo.worker2.get(f"/v1/videos/{job}").status_code == 200
        assert dynamo.worker.get(f"/v1/videos/{job}").status_code == 404


def test_a_workflow_id_is_served_through_dynamos_frontend(dynamo):
    assert WORKFLOW in {m["id"] for m in dynamo.frontend.get("/v1/models").json()["data"]}
    body = {
        "model": WORKFLOW,
        "prompt": "a fox in a workflow",
        "response_format": "b64_json",
        "nvext": {"seed": 4},
    }
    answer = dynamo.frontend.post("/v1/videos", json=body).json()
    assert answer["status"] == "completed" and answer["model"] == WORKFLOW, answer
    job = dynamo.reference.post(
        "/v1/videos", json={"model": WORKFLOW, "prompt": body["prompt"], "seed": 4}
    ).json()
    deadline = time.monotonic() + 60
    while job["status"] in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
        job = dynamo.reference.get(f"/v1/videos/{job['id']}").json()
    want = dynamo.reference.get(f"/v1/videos/{job['id']}/content").content
    assert base64.b64decode(answer["data"][0]["b64_json"]) == want  # bitwise: the same bytes as fv serve


def test_frontend_body_moves_fv_params_into_nvext_and_refuses_what_the_frontend_would_drop(dynamo):
    body = frontend_body({"model": TINY, "prompt": "x", "size": "32x32", "seed": 2, "num_frames": 5,
                          "nvext": {"num_inference_steps": 2}})  # fmt: skip
    assert body == {"model": TINY, "prompt": "x", "size": "32x32",
                    "nvext": {"num_inference_steps": 2, "seed": 2, "num_frames": 5}}  # fmt: skip
    with pytest.raises(ConfigError, match=r"'flow_shift'.*drops.*Fix") as refused:
        frontend_body({**SHORT, "flow_shift": 3.0})
    assert "nvext" in str(refused.value)
    # what it keeps reaches the worker (a bad value comes back refused by fv, naming it); what it refuses
    # is dropped by Dynamo's frontend (the same bad value goes unnoticed: the job completes without it)
    kept = dynamo.frontend.post("/v1/videos", json=frontend_body({**SHORT, "num_frames": 500})).json()
    assert kept["status"] == "failed" and "num_frames=500" in kept["error"], kept
    assert (
        dynamo.reference.post(
            "/v1/videos", json={"model": TINY, "prompt": "x", "flow_shift": "many"}
        ).status_code
        == 400
    )
    for lost in (
        {**SHORT, "flow_shift": "many"},
        {**SHORT, "nvext": {**SHORT["nvext"], "flow_shift": "many"}},
    ):
        assert dynamo.frontend.post("/v1/videos", json=lost).json()["status"] == "completed"
