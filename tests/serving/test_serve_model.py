"""``fv serve MODEL``: a card id served without a deploy file, through the real CLI; bad arguments are
errors naming the value, the rule and the fix."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import openai
import pytest

from fv_core.cli import main
from tests.serving.support import SMALL, TINY, free_port


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``fv serve wan2.1-t2v-tiny`` in its own process on a free port; its URL once /v1/models answers."""
    port = free_port()
    env = {**os.environ, "FV_PLUGINS": "fv-wan", "FV_CACHE_DIR": str(tmp_path_factory.mktemp("cache"))}
    data = tmp_path_factory.mktemp("data")
    command = [
        sys.executable,
        "-m",
        "fv_core.cli",
        "serve",
        TINY,
        "--port",
        str(port),
        "--data-dir",
        str(data),
    ]
    server = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            httpx.get(f"{url}/v1/models").raise_for_status()
            break
        except httpx.HTTPError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                pytest.fail(f"fv serve {TINY} did not start: {server.communicate()[1][-2000:]}")
            time.sleep(0.2)
    yield url
    server.terminate()  # SIGTERM: the server drains and exits
    assert server.wait(timeout=60) == 0


def test_serve_a_card_id_answers_models_and_a_request(served):
    client = openai.OpenAI(base_url=f"{served}/v1", api_key="-", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == [TINY]
    job = client.videos.create_and_poll(model=TINY, prompt="a cat", **SMALL)
    assert job.status == "completed", job.error
    assert client.videos.download_content(job.id).read()[4:8] == b"ftyp"  # an mp4


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["no-such-model"], ["fv serve no-such-model", "neither a deploy file", TINY, "Fix: pass a card id"]),
        (["missing.yaml"], ["'missing.yaml' does not exist", "Fix:"]),
        (["--ray", TINY], [f"--ray {TINY}", "a fleet is served from a deploy file", "Fix:"]),
    ],
)
def test_bad_serve_target_names_the_value_the_rule_and_the_fix(argv, says, capsys):
    assert main(["serve", *argv, "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert all(s in err for s in says), err


def test_a_folder_needs_a_reader_and_weights_go_with_a_model(tmp_path, capsys):
    assert main(["serve", str(tmp_path), "--port", "1"]) == 2  # a folder: its card from its configs
    assert "has no model_index.json, and no installed folder reader" in capsys.readouterr().err
    deploy = tmp_path / "d.yaml"
    deploy.write_text(f"plugins: [fv-wan]\nmodels:\n  - card: {TINY}\n")
    assert main(["serve", str(deploy), "--weights", str(tmp_path), "--port", "1"]) == 2
    assert "a deploy file names each model's weights. Fix: set `weights:`" in capsys.readouterr().err
