"""A cancel storm: 30 seeded jobs, every other one deleted while queued or running; the rest are untouched."""

from __future__ import annotations

import re
import time

import httpx
import openai
import pytest

from tests.serving.support import TINY, ServerThread, tiny_deploy, wait_idle

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the client marks Sora APIs deprecated

JOBS = 30
STEPS = 200  # the first jobs are mid-run while the deletes arrive, the last still queued (even under load:
# at 30 and at 100 steps a job ran all its steps between two polls on a loaded 2-core machine; 200: the card's most)


def ask(i: int) -> dict:
    """Job i's request: its own prompt and seed."""
    return {
        "prompt": f"storm job {i}: a lighthouse in the fog",
        "model": TINY,
        "size": "32x32",
        "extra_body": {"num_frames": 5, "num_inference_steps": STEPS, "seed": 1000 + i},
    }


def jobs_total(server: ServerThread, status: str) -> float:
    metrics = httpx.get(f"{server.url}/metrics").text
    found = re.search(rf'^fv_jobs_total{{model="{TINY}",status="{status}"}} (\S+)$', metrics, re.M)
    return float(found[1]) if found else 0.0


def test_a_cancel_storm_leaves_the_kept_jobs_bitwise_untouched(host, tmp_path):
    deploy = tiny_deploy(tmp_path, max_steps=STEPS)  # determinism: bitwise; 8 running, 64 queued
    with ServerThread(deploy, host) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0, timeout=60)
        assert client.models.list().data[0].model_extra["determinism"] == "bitwise"

        ids = [client.videos.create(**ask(i)).id for i in range(JOBS)]
        deleted, kept = ids[1::2], ids[0::2]

        deadline = time.monotonic() + 30  # the first job to delete is mid-run before the storm starts
        while (first := client.videos.retrieve(deleted[0])).status != "in_progress":
            assert first.status == "queued" and time.monotonic() < deadline, first
            time.sleep(0.005)
        was: dict[str, str] = {}
        for video_id in deleted:
            was[video_id] = client.videos.retrieve(video_id).status
            assert client.videos.delete(video_id).deleted
        assert "in_progress" in was.values() and "queued" in was.values(), was  # both kinds were cancelled
        assert "completed" not in was.values(), was

        for video_id in deleted:
            with pytest.raises(openai.NotFoundError):
                client.videos.retrieve(video_id)
            with pytest.raises(openai.NotFoundError):
                client.videos.download_content(video_id)
            with pytest.raises(openai.NotFoundError):
                client.videos.delete(video_id)

        finished = {video_id: client.videos.poll(video_id, poll_interval_ms=20) for video_id in kept}
        for video_id, video in finished.items():
            assert video.status == "completed" and video.progress == 100, (video_id, video.error)
        storm = {video_id: client.videos.download_content(video_id).read() for video_id in kept}
        assert len(set(storm.values())) == len(kept)  # distinct seeds and prompts, distinct videos

        # Nothing of the deleted jobs is left: no engine place, reservation, file or listing.
        wait_idle(server, timeout=10)
        engine = server.service.engine
        assert engine.engine.admission.usage() == {"compute_s": 0.0, "memory_bytes": 0, "running": 0}
        assert engine._records == {}  # a leaked record would hold one of the queue's places forever
        files = {p.name for p in server.service.store.videos.iterdir()}
        assert files == {f"{i}.{ext}" for i in kept for ext in ("mp4", "json")}, files
        listed = {v.id for v in client.videos.list(limit=100).data}
        assert listed == set(kept)
        assert jobs_total(server, "cancelled") == len(deleted)
        assert jobs_total(server, "completed") == len(kept)
        assert jobs_total(server, "failed") == 0

        # Each kept video is the one the same request makes alone, afterwards, on the idle server.
        for i in range(0, JOBS, 2):
            assert server.service.live == {}
            solo = client.videos.create_and_poll(poll_interval_ms=20, **ask(i))
            assert solo.status == "completed", solo.error
            assert client.videos.download_content(solo.id).read() == storm[ids[i]], f"job {i} differs"
