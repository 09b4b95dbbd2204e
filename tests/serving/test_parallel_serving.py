"""`fv serve` with a parallel deploy entry: jobs run on the group, a killed worker fails the job it was
on with the reason and the server goes on (the group restarts), shutdown stops every worker."""

from __future__ import annotations

import os
import signal

import openai
import pytest

from fv_core.deploy.card import parse_deploy
from tests.serving.support import SMALL, TINY, ServerThread

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_parallel_deploy_serves_survives_a_dead_worker_and_stops_its_workers(host, tmp_path):
    deploy = parse_deploy(
        {"plugins": ["fv-wan"], "models": [{"card": TINY, "parallel": "cfg=2"}], "data_dir": str(tmp_path)}
    )
    with ServerThread(deploy, host) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0)
        group = server.service.models[TINY].loaded.parallel
        workers = list(group._procs)
        first = client.videos.create_and_poll(prompt="on two ranks", poll_interval_ms=20, **SMALL)
        assert first.status == "completed"

        os.kill(group.alive_workers()[0], signal.SIGKILL)
        failed = client.videos.create_and_poll(prompt="its worker died", poll_interval_ms=20, **SMALL)
        assert failed.status == "failed" and failed.error is not None
        assert "WorkerFailed" in failed.error.message and "rank 1 (exit code -9)" in failed.error.message

        again = client.videos.create_and_poll(prompt="on two ranks", poll_interval_ms=20, **SMALL)
        assert again.status == "completed" and group.restarts == 1
        assert (
            client.videos.download_content(again.id).read() == client.videos.download_content(first.id).read()
        )
        restarted = list(group._procs)
    assert all(p.poll() is not None for p in workers + restarted), "shutdown stopped every worker"


def test_serve_parallel_flag_sets_the_one_models_plan():
    from fv_core import ConfigError
    from fv_core.serving.cli import with_parallel

    one = parse_deploy({"models": [{"card": TINY}]})
    assert with_parallel(one, "cfg=2, sp=2").models[0].parallel == "sp=2,cfg=2"
    assert with_parallel(one, None) is one
    two = parse_deploy({"models": [{"card": TINY}, {"card": TINY, "name": "other"}]})
    with pytest.raises(
        ConfigError, match=r"serves 2 models \['wan2.1-t2v-tiny', 'other'\].*one model's entry"
    ):
        with_parallel(two, "sp=2")
    with pytest.raises(ConfigError, match="'sp=x' is not AXIS=DEGREE"):
        with_parallel(one, "sp=x")
