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


@pytest.fixture(scope="session")
def postgres():
    """One throwaway PostgreSQL cluster for the session (started on first use)."""
    from tests.serving.postgres import PostgresCluster

    with PostgresCluster() as cluster:
        yield cluster


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request) -> str | None:
    """Each store-level test on both job stores: SQLite in the data dir (None), a fresh PostgreSQL database."""
    return request.getfixturevalue("postgres").database() if request.param == "postgresql" else None


@pytest.fixture(scope="session")
def s3():
    """One S3-compatible server process (moto_server) for the session, with a bucket; AWS_* set meanwhile."""
    from tests.serving.s3 import S3Server

    with S3Server() as server:
        yield server
