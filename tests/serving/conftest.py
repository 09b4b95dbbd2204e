"""Session fixtures: one tiny Wan checkpoint, one server on a free port, openai clients pointed at it."""

from __future__ import annotations

import openai
import pytest

from tests.serving.support import ServerThread, tiny_deploy, wan_host

API_KEY = "test-key"


@pytest.fixture(scope="session")
def host(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("FV_CACHE_DIR", str(tmp_path_factory.mktemp("fv-cache")))
    yield wan_host()
    mp.undo()


@pytest.fixture(scope="session")
def server(host, tmp_path_factory):
    deploy = tiny_deploy(
        tmp_path_factory.mktemp("data"), max_frames=9, max_steps=200, max_queue=4, max_running=2
    )
    with ServerThread(deploy, host, api_key=API_KEY) as srv:
        yield srv


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
