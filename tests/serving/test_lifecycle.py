"""The job lifecycle through the official openai client: create, poll, download, list, delete, images."""

from __future__ import annotations

import base64
import io
import json
import threading
import time

import httpx
import openai
import pytest
from PIL import Image

from tests.serving.support import SMALL, TINY, wait_idle

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the client marks Sora APIs deprecated


def wait_for(client: openai.OpenAI, video_id: str, until, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        video = client.videos.retrieve(video_id)
        if until(video):
            return video
        time.sleep(0.02)
    raise AssertionError(f"{video_id} never reached the state; last: {video}")


def test_video_lifecycle(server, client):
    created = client.videos.create(prompt="a cat on a boat", model=TINY, **SMALL)
    assert created.object == "video" and created.status == "queued" and created.progress == 0
    assert created.model == TINY and created.size == "32x32" and created.created_at > 0

    done = client.videos.poll(created.id, poll_interval_ms=20)
    assert done.status == "completed" and done.progress == 100 and done.error is None
    assert done.completed_at >= done.created_at
    assert (done.size, done.seconds) == ("32x32", "0.3125")  # 5 frames at 16 fps

    mp4 = client.videos.download_content(done.id).read()
    assert mp4[4:8] == b"ftyp" and len(mp4) > 1000
    provenance = server.service.store.video_path(done.id).with_suffix(".json")  # as `fv generate` writes it
    recorded = json.loads(provenance.read_text())
    assert recorded["card"] == TINY and recorded["params"]["prompt"] == "a cat on a boat"

    other = client.videos.create_and_poll(prompt="a dog", **SMALL)  # default model: the first deployed
    assert other.status == "completed" and other.model == TINY

    page = client.videos.list(limit=1, order="desc")
    assert [v.id for v in page.data] == [other.id] and page.has_more
    older = client.videos.list(limit=1, order="desc", after=other.id)
    assert [v.id for v in older.data] == [done.id]
    assert done.id in [v.id for v in client.videos.list(order="asc", limit=100).data]

    deleted = client.videos.delete(done.id)
    assert (deleted.id, deleted.deleted, deleted.object) == (done.id, True, "video.deleted")
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(done.id)
    with pytest.raises(openai.NotFoundError):
        client.videos.download_content(done.id)
    assert not provenance.exists()


def test_json_body_and_seconds(server, client):
    body = {"prompt": "a bird", "seconds": "0.25", "size": "32x32", "num_inference_steps": 2, "seed": 3}
    response = httpx.post(f"{server.url}/v1/videos", json=body, headers={"Authorization": "Bearer test-key"})
    assert response.status_code == 200, response.text
    video = client.videos.poll(response.json()["id"], poll_interval_ms=20)
    assert video.status == "completed" and video.seconds == "0.3125"  # 0.25 s * 16 fps + 1 = 5 frames


def test_progress_is_reported_every_step(server, client, monkeypatch):
    store = server.service.store
    written: list[int] = []
    record = store.progress

    def progress(job_id: str, percent: int) -> None:
        written.append(percent)
        record(job_id, percent)

    monkeypatch.setattr(store, "progress", progress)
    video = client.videos.create(
        prompt="a slow river", size="32x32", extra_body={"num_frames": 5, "num_inference_steps": 40}
    )
    video = client.videos.poll(video.id, poll_interval_ms=20)
    assert video.status == "completed" and video.progress == 100, video.error
    assert written == sorted(written) and len(written) >= 40  # one write per step, never going back
    assert len({p for p in written if 0 < p < 100}) >= 30  # many intermediate values, not just start and end


def test_images_generate(client):
    result = client.images.generate(
        prompt="a red flower",
        model=TINY,
        n=2,
        size="32x32",
        response_format="b64_json",
        extra_body={"num_inference_steps": 2, "seed": 5},
    )
    assert len(result.data) == 2 and result.created > 0
    images = [Image.open(io.BytesIO(base64.b64decode(d.b64_json))) for d in result.data]
    assert all(im.size == (32, 32) and im.format == "PNG" for im in images)
    assert images[0].tobytes() != images[1].tobytes()  # seeds 5 and 6


def test_many_images_are_admitted_one_by_one_and_do_not_starve_others(server, client):
    # the server runs 2 and queues 4: 8 images at once would not fit, and used to be refused whole
    many: dict = {}
    images = threading.Thread(
        target=lambda: many.update(
            result=client.images.generate(
                prompt="eight flowers", model=TINY, n=8, size="32x32", extra_body={"num_inference_steps": 2}
            )
        )
    )
    images.start()
    deepest = 0
    while images.is_alive() and deepest < 8:  # the queue depth the autoscaler reads counts awaited images
        deepest = max(deepest, server.service.queue_depth)
        time.sleep(0.002)
    assert deepest >= 8, "the 8 awaited images never counted in the queue depth"
    others = [client.videos.create(prompt=f"meanwhile {i}", **SMALL) for i in range(3)]  # room is left
    images.join()
    assert len(many["result"].data) == 8 and server.service.images_in_flight == 0
    done = [client.videos.poll(v.id, poll_interval_ms=20) for v in others]
    assert all(v.status == "completed" for v in done), [v.error for v in done]
    wait_idle(server)


def test_concurrent_jobs(client):
    ids: list[str] = []

    def submit(seed: int) -> None:
        ids.append(
            client.videos.create(
                prompt=f"a boat {seed}",
                size="32x32",
                extra_body={"num_frames": 5, "num_inference_steps": 3, "seed": seed},
            ).id
        )

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(ids) == 4
    finished = [client.videos.poll(i, poll_interval_ms=20) for i in ids]
    assert all(v.status == "completed" for v in finished)
    assert (
        len({client.videos.download_content(i).read() for i in ids}) == 4
    )  # different seeds, different videos


def test_cancel_mid_run_frees_resources(server, client):
    video = client.videos.create(
        prompt="a long film", size="32x32", extra_body={"num_frames": 5, "num_inference_steps": 150}
    )
    running = wait_for(client, video.id, lambda v: v.status == "in_progress" and v.progress > 0)
    assert running.progress < 100
    assert client.videos.delete(video.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(video.id)
    wait_idle(server, timeout=10)  # the job ended at a step boundary, long before its 150 steps
    assert server.service.engine.engine.admission.usage()["running"] == 0
    assert not (server.service.store.videos / f"{video.id}.mp4").exists()
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'fv_jobs_total{model="wan2.1-t2v-tiny",status="cancelled"}' in metrics


def test_models_health_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [TINY]
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
    metrics = httpx.get(f"{server.url}/metrics").text
    for name in (
        "fv_queue_depth",
        "fv_running_requests",
        "fv_steps_per_second",
        "fv_steps_total",
        "fv_job_latency_seconds_bucket",
        "fv_job_queue_seconds_bucket",
        "fv_jobs_total",
    ):
        assert name in metrics


def test_the_request_schema_is_the_served_cards_params(server):
    """The OpenAPI body of POST /v1/videos is OpenAI's fields plus the deployed loops' Params."""
    spec = httpx.get(f"{server.url}/openapi.json").json()
    body = spec["paths"]["/v1/videos"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    fields = body["properties"]
    assert {"prompt", "model", "size", "seconds", "plugin_options"} <= set(fields)  # OpenAI's
    assert {"num_inference_steps", "guidance_scale", "sampler", "flow_shift", "max_sequence_length"} <= set(
        fields
    )
    sampler = next(a for a in fields["sampler"]["anyOf"] if "enum" in a)
    assert (
        sampler["enum"] == ["unipc", "euler", "dmd"] and fields["num_inference_steps"]["limit"] == "max_steps"
    )
    assert fields["guidance_scale"]["description"] == "CFG scale; 1 turns CFG off"


def test_a_seeded_request_gives_the_same_video_whatever_else_runs(server, client):
    """determinism: bitwise (this deploy's): steps of different requests share a call only through their
    batch-invariant bodies, so the bytes do not change."""
    assert client.models.list().data[0].model_extra["determinism"] == "bitwise"
    ask = {"size": "32x32", "extra_body": {"num_frames": 5, "num_inference_steps": 3, "seed": 7}}
    alone = client.videos.create_and_poll(prompt="a cat on a boat", poll_interval_ms=20, **ask)
    solo = client.videos.download_content(alone.id).read()
    others = [
        client.videos.create(prompt=f"a dog number {i}", size="32x32",
                             extra_body={"num_frames": 5, "num_inference_steps": 3, "seed": i})
        for i in range(3)
    ]  # fmt: skip
    again = client.videos.create_and_poll(prompt="a cat on a boat", poll_interval_ms=20, **ask)
    assert client.videos.download_content(again.id).read() == solo
    for video in others:
        client.videos.poll(video.id, poll_interval_ms=20)
