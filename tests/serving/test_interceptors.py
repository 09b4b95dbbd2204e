"""Interceptors the deploy file enables run on the served model; requests tune them within the schema."""

from __future__ import annotations

import re

import httpx
import openai
import pytest

from fv_core.deploy.card import parse_deploy
from fv_core.plugins import load_plugins
from tests.serving.support import TINY, ServerThread

CACHE = "fv-cache-dit"


@pytest.fixture(scope="module")
def cached_server(host, tmp_path_factory):
    deploy = parse_deploy(
        {
            "plugins": ["fv-wan", CACHE],
            "models": [{"card": TINY, "interceptors": ["fbcache"]}],
            "plugin_options": {CACHE: {"max_warmup_steps": 2}},
            "data_dir": str(tmp_path_factory.mktemp("cached")),
        }
    )
    with ServerThread(deploy, load_plugins(env={"FV_PLUGINS": f"fv-wan,{CACHE}"})) as srv:
        yield srv


def cache_steps(server: ServerThread) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics").text
    pattern = r'fv_cache_steps_total\{decision="(\w+)",interceptor="fbcache",model="[^"]+"\} ([\d.]+)'
    return {decision: float(n) for decision, n in re.findall(pattern, text)}


def test_deploy_enabled_interceptor_caches_and_reports_in_metrics(cached_server):
    client = openai.OpenAI(base_url=f"{cached_server.url}/v1", api_key="-", max_retries=0)
    steps = {"num_frames": 5, "num_inference_steps": 8, "seed": 2}
    never = client.videos.create_and_poll(
        prompt="a cat",
        size="32x32",
        extra_body={**steps, "plugin_options": {CACHE: {"residual_diff_threshold": 0}}},
    )
    assert never.status == "completed", never.error
    assert cache_steps(cached_server) == {"computed": 16.0, "cached": 0.0}  # 8 steps x 2 CFG branches
    always = client.videos.create_and_poll(
        prompt="a cat",
        size="32x32",
        extra_body={**steps, "plugin_options": {CACHE: {"residual_diff_threshold": 1}}},
    )
    assert always.status == "completed", always.error
    counts = cache_steps(cached_server)
    assert counts["cached"] > 0 and counts["computed"] + counts["cached"] == 32


def test_request_options_outside_the_schema_are_400(cached_server):
    client = openai.OpenAI(base_url=f"{cached_server.url}/v1", api_key="-", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.videos.create(
            prompt="a cat", size="32x32", extra_body={"plugin_options": {CACHE: {"warmup": 3}}}
        )
    assert "warmup" in info.value.message and "Allowed:" in info.value.message


def test_options_the_model_cannot_run_are_400_before_queueing(cached_server):
    """Valid by the schema, impossible for a 2-block transformer: refused at submit on both routes."""
    client = openai.OpenAI(base_url=f"{cached_server.url}/v1", api_key="-", max_retries=0)
    impossible = {"plugin_options": {CACHE: {"Fn_compute_blocks": 2, "Bn_compute_blocks": 1}}}
    before = len(client.videos.list(limit=100).data)
    with pytest.raises(
        openai.BadRequestError, match=r"Fn_compute_blocks=2 \+ Bn_compute_blocks=1 exceed the model's 2"
    ):
        client.videos.create(prompt="a cat", size="32x32", extra_body=impossible)
    with pytest.raises(openai.BadRequestError, match="exceed the model's 2 blocks"):
        client.images.generate(prompt="a cat", size="32x32", extra_body=impossible)
    assert len(client.videos.list(limit=100).data) == before  # no job was created
