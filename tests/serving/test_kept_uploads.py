"""A queued job with an upload (``input_reference``) survives a restart: the upload is kept in the job
store with the request, and the next server runs the job on it (before, such jobs came back failed,
``server_restart``)."""

from __future__ import annotations

import io
import json

import numpy as np
import openai
import pytest
from PIL import Image

from fv_core.deploy.card import parse_deploy
from fv_core.serving.jobs import JobStore, new_job_id
from fv_wan.tiny import write_tiny_checkpoint
from tests.serving.support import ServerThread

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
I2V = "wan2.1-i2v-tiny"


def test_a_queued_job_with_an_upload_runs_after_a_restart(host, tmp_path):
    write_tiny_checkpoint(tmp_path / "i2v", seed=11, variant="i2v")
    deploy = parse_deploy({
        "plugins": ["fv-wan"], "models": [{"card": I2V, "weights": str(tmp_path / "i2v")}],
        "data_dir": str(tmp_path / "data"),
    })  # fmt: skip
    png = io.BytesIO()
    Image.fromarray((np.random.default_rng(3).random((32, 48, 3)) * 255).astype(np.uint8)).save(png, "PNG")
    # what a server stopped with the job still queued leaves: its row, its request and its upload
    raw = {
        "prompt": "kept with its image",
        "seed": 7,
        "width": 48,
        "height": 32,
        "num_inference_steps": 2,
        "num_frames": 5,
    }
    kept = {"raw": raw, "task": "i2v", "plugin_options": {}, "adapters": []}
    store, waiting = JobStore(tmp_path / "data"), new_job_id()
    store.create(waiting, I2V, "48x32", "auto", raw["prompt"], kept, upload=png.getvalue())
    store.close()

    with ServerThread(deploy, host) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="-", max_retries=0)
        done = client.videos.poll(waiting, poll_interval_ms=20)
        assert done.status == "completed", done
        recorded = json.loads(srv.service.store.video_path(waiting).with_suffix(".json").read_text())
        assert recorded["task"] == "i2v" and recorded["parts"] == ["image"]
        again = client.videos.create_and_poll(
            prompt=raw["prompt"], size="48x32", input_reference=("first.png", png.getvalue(), "image/png"),
            extra_body={"seed": 7, "num_inference_steps": 2, "num_frames": 5}, poll_interval_ms=20,
        )  # fmt: skip
        assert srv.service.store.upload(again.id) == png.getvalue()  # an HTTP upload is kept the same way
        same = [client.videos.download_content(v).read() for v in (waiting, again.id)]
        assert same[0] == same[1]  # the kept job ran on its upload: the same video as the request made now
