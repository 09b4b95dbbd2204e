"""``fv serve FOLDER|OWNER/NAME``: a checkpoint served without a card id or a deploy file, its card built
from its configs as ``fv generate --weights`` builds it; deploy entries naming a checkpoint as their card
are checked as load reads them."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from fv_core.deploy import check_deploy
from fv_core.deploy.card import DeploymentCard
from fv_core.errors import ConfigError, WeightsError
from fv_core.plugins import load_plugins
from fv_core.serving.cli import served_deploy
from tests.core.test_hub import REPO, cache_repo
from tests.serving.support import SMALL, free_port


@pytest.fixture(scope="module")
def tiny() -> Path:
    """wan2.1-t2v-tiny's checkpoint folder (diffusers layout, model_index.json)."""
    from fv_wan.tiny import tiny_weights

    return Path(tiny_weights())


@pytest.fixture(scope="module")
def host():
    return load_plugins()


def test_a_repo_id_is_served_from_the_offline_cache_by_its_id(tiny, tmp_path):
    cache = tmp_path / "hf-hub"
    cache_repo(cache, REPO, tiny)
    port = free_port()
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "FV_PLUGINS": "fv-wan"}
    command = [
        sys.executable,
        "-m",
        "fv_core.cli",
        "serve",
        REPO,
        "--port",
        str(port),
        "--data-dir",
        str(tmp_path),
    ]
    server = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                httpx.get(f"{url}/v1/models").raise_for_status()
                break
            except httpx.HTTPError:
                if server.poll() is not None or time.monotonic() > deadline:
                    server.kill()
                    pytest.fail(f"fv serve {REPO} did not start: {server.communicate()[1][-2000:]}")
                time.sleep(0.2)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == [REPO]
        job = client.videos.create_and_poll(model=REPO, prompt="a cat", **SMALL)  # the card's params accepted
        assert job.status == "completed", job.error
        assert client.videos.download_content(job.id).read()[4:8] == b"ftyp"
    finally:
        server.terminate()
        server.wait(timeout=60)


def test_a_folder_is_served_by_its_path_with_the_plugin_that_reads_it(tiny, host):
    deploy = served_deploy(host, str(tiny), None)
    assert deploy.plugins == ["fv-wan"] and [m.served_name for m in deploy.models] == [str(tiny)]
    assert check_deploy(deploy, host) == []


def test_checkpoint_errors_name_the_value_the_rule_and_the_fix(tiny, host, tmp_path):
    with pytest.raises(ConfigError, match=f"is a checkpoint already.*Fix: fv serve {tiny}, or fv serve CARD"):
        served_deploy(host, str(tiny), "other/weights")
    with pytest.raises(WeightsError, match="has no model_index.json, and no installed folder reader.*Fix:"):
        served_deploy(host, str(tmp_path), None)
    entry = {"card": str(tiny), "kernels": {"attention": "sdpa"}}
    problems = check_deploy(DeploymentCard(plugins=["fv-wan"], models=[entry]), host)
    assert len(problems) == 1 and "sets ['kernels'], which are chosen on a registered card" in problems[0]
    assert f"Fix: name its card (`fv cards`) with weights: {tiny}" in problems[0]
    problems = check_deploy(DeploymentCard(plugins=[], models=[{"card": str(tiny)}]), host)
    assert problems == [
        f"models[0].card: {str(tiny)!r} is read by plugin 'fv-wan', which this deploy "
        "does not enable. Fix: add 'fv-wan' to 'plugins'."
    ]
