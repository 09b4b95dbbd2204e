"""Hot weight sync through a real ``fv serve``: a trainer pushes weights (``push_weights``) while jobs run.

The engine's worker is parked at a step boundary while two jobs are mid-run, the push is queued
behind it, and the worker let go: the swap lands with both jobs in flight, deterministically. Jobs
accepted before the push download bit for bit the mp4 of a run on the old weights alone, jobs
accepted after it that of a run on the new weights alone. A wrong key is 401, a tensor of the wrong
shape 400 naming it, a reused version 409; none of them changes the weights or fails a job.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import torch

import fv_core
from fv_core import ConfigError
from fv_core.training import WeightSyncPlan, push_weights
from fv_core.training.sync import encode
from tests.serving.support import TINY, ServerThread, tiny_deploy

KEY = "sync-key"
STEPS = 30  # long enough to park the worker with both jobs mid-run
ASK = {"size": "32x32", "num_frames": 5, "num_inference_steps": STEPS}
PLAN = WeightSyncPlan(role="student", components=["transformer"], version="step-1")


@pytest.fixture(scope="module")
def deploy(tmp_path_factory):
    return tiny_deploy(
        tmp_path_factory.mktemp("sync-data"), max_frames=9, max_steps=200, max_queue=8, max_running=2
    )


@pytest.fixture(scope="module")
def srv(host, deploy):
    """A server of its own: the sync changes its weights."""
    with ServerThread(deploy, host, api_key=KEY) as server:
        yield server


@pytest.fixture(scope="module")
def new_weights(srv):
    live = srv.service.models[TINY].loaded.instance.component("transformer").state_dict()
    gen = torch.Generator().manual_seed(0)
    return {
        k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in live.items() if v.is_floating_point()
    }


def create(srv, prompt: str, seed: int) -> str:
    body = {"prompt": prompt, "seed": seed, **ASK}
    response = httpx.post(f"{srv.url}/v1/videos", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == 200, response.text
    return response.json()["id"]


def finished(srv, job: str) -> bytes:
    """The job's mp4, once it completed."""
    auth, deadline = {"Authorization": f"Bearer {KEY}"}, time.monotonic() + 120
    while (video := httpx.get(f"{srv.url}/v1/videos/{job}", headers=auth).json())["status"] != "completed":
        assert video["status"] in ("queued", "in_progress") and time.monotonic() < deadline, video
        time.sleep(0.02)
    return httpx.get(f"{srv.url}/v1/videos/{job}/content", headers=auth).content


def mp4(model, tmp_path, prompt: str, seed: int) -> bytes:
    """What a server on ``model``'s weights alone answers for the same request."""
    video = model.generate(
        prompt=prompt, seed=seed, width=32, height=32, num_frames=5, num_inference_steps=STEPS
    )
    return video.save(tmp_path / f"{seed}-{len(prompt)}.mp4").read_bytes()


def park_mid_run(engine, jobs: int) -> threading.Event:
    """Hold the engine's worker at a step boundary once ``jobs`` requests are all mid-run; returns the
    event that lets it go."""
    gate, parked = threading.Event(), threading.Event()

    def park(sched) -> None:
        steps = [e.active_loop.state.step for e in sched.entries.values()]
        if len(steps) == jobs and all(0 < s < STEPS for s in steps):
            parked.set()
            gate.wait(60)

    deadline = time.monotonic() + 60
    while not parked.is_set():
        future = engine.at_boundary(park)
        while not (future.done() or parked.is_set()):
            assert time.monotonic() < deadline, "the jobs were never mid-run together"
            time.sleep(0.0005)
    return gate


def test_a_push_mid_run_keeps_jobs_on_the_weights_they_started_with(
    srv, deploy, host, new_weights, tmp_path, monkeypatch
):
    inst = srv.service.models[TINY].loaded.instance
    old = inst.weights_versions["transformer"]
    before = [("a red circle moving left", 1), ("a blue square moving up", 2)]
    after = [("a red circle moving left", 1), ("a green square moving down", 3)]
    jobs = [create(srv, *ask) for ask in before]

    engine, queued, answer = srv.service.engine, threading.Event(), []
    gate = park_mid_run(engine, len(before))
    text, kv = len(inst.feature_cache), len(inst.kv_cache)  # the prompts' embeddings and K/V (+ negative's)
    assert text == kv == 3
    at_boundary = engine.at_boundary

    def spy(fn):  # the push's swap is queued behind the parked worker
        future = at_boundary(fn)
        queued.set()
        return future

    monkeypatch.setattr(engine, "at_boundary", spy)
    pusher = threading.Thread(
        target=lambda: answer.append(push_weights(srv.url, PLAN, new_weights, api_key=KEY))
    )
    pusher.start()
    assert queued.wait(60)
    gate.set()
    pusher.join(60)
    [synced] = answer
    assert synced["object"] == "weights.sync" and synced["model"] == TINY and synced["role"] == "student"
    assert synced["versions"] == {"transformer": "step-1"} and synced["previous"] == {"transformer": old}
    assert synced["tensors"] == {"transformer": len(new_weights)} and synced["requests_on_previous"] == 2
    assert synced["cache_entries_dropped"] == kv and len(inst.kv_cache) == 0  # the transformer's K/V
    assert len(inst.feature_cache) == text  # the text encoder's embeddings stay
    jobs += [create(srv, *ask) for ask in after]

    videos = [finished(srv, job) for job in jobs]
    old_ref = fv_core.load(TINY, deploy=deploy, host=host)
    new_ref = fv_core.load(TINY, deploy=deploy, host=host)
    new_ref.instance.component("transformer").load_state_dict(new_weights, strict=False)
    assert videos[:2] == [mp4(old_ref, tmp_path, *ask) for ask in before]
    assert videos[2:] == [mp4(new_ref, tmp_path, *ask) for ask in after]
    assert videos[0] != videos[2]  # the same request, on the new weights
    for job, version in zip(jobs, [old, old, "step-1", "step-1"], strict=True):
        provenance = srv.service.store.video_path(job).with_suffix(".json").read_text()
        assert f'"transformer": "{version}"' in provenance
    assert inst.retired_versions == []  # the old transformer went with the last job on it


def test_refused_pushes_change_nothing(srv, new_weights):
    """Runs after the push above: the live version is step-1."""
    inst = srv.service.models[TINY].loaded.instance
    live = inst.component("transformer")
    job = create(srv, "a purple circle moving right", 5)
    plan = PLAN.model_copy(update={"version": "step-2"})
    files = {"weights": ("w.safetensors", encode(plan, new_weights))}
    wrong_key = httpx.post(
        f"{srv.url}/v1/weights",
        data={"plan": plan.model_dump_json()},
        files=files,
        headers={"Authorization": "Bearer wrong"},
    )
    assert wrong_key.status_code == 401 and wrong_key.json()["error"]["code"] == "invalid_api_key"
    name = "blocks.0.ffn.net.0.proj.weight"
    with pytest.raises(ConfigError, match=rf"HTTP 400.*tensor 'transformer.{name}' has shape \(2, 2\)"):
        push_weights(srv.url, plan, {**new_weights, name: torch.zeros(2, 2)}, api_key=KEY)
    with pytest.raises(ConfigError, match="HTTP 409.*version 'step-1' of 'transformer' is already resident"):
        push_weights(srv.url, PLAN, new_weights, api_key=KEY)
    with pytest.raises(ConfigError, match="HTTP 400.*not a training role"):
        push_weights(srv.url, plan.model_copy(update={"role": "trainer"}), new_weights, api_key=KEY)
    assert finished(srv, job)[4:8] == b"ftyp"  # the job running meanwhile completed
    assert inst.component("transformer") is live and inst.weights_versions["transformer"] == "step-1"
