"""LoRA adapters over HTTP: added and removed on a running server, listed by /v1/models, named per
request through the openai SDK's extra_body, and every bad adapter answered 4xx with value, rule, fix."""

from __future__ import annotations

import httpx
import pytest
from safetensors.torch import save_file

from fv_core.adapters import random_lora
from tests.serving.support import SMALL, TINY

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
AUTH = {"Authorization": "Bearer test-key"}


@pytest.fixture(scope="module")
def style(server, tmp_path_factory) -> str:
    dit = server.service.models[TINY].loaded.instance.component("transformer")
    path = tmp_path_factory.mktemp("lora") / "style.safetensors"
    save_file(random_lora(dit, ("attn1.to_q", "attn1.to_v", "ffn.net.2"), seed=3, std=0.5), path)
    return str(path)


def post(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/adapters", json=body, headers=AUTH, timeout=60)


def video(client, **extra) -> bytes:
    body = {**SMALL, "extra_body": {**SMALL["extra_body"], **extra}}
    done = client.videos.create_and_poll(prompt="a lantern", poll_interval_ms=20, **body)
    assert done.status == "completed", done.error
    return client.videos.download_content(done.id).read()


def test_add_list_use_and_remove_an_adapter_while_serving(server, client, style):
    added = post(server, {"name": "style", "path": style, "scale": 0.8})
    assert added.status_code == 200, added.text
    assert added.json()["model"] == TINY and added.json()["scale"] == 0.8
    [model] = [m for m in client.models.list().data if m.id == TINY]
    assert [a["name"] for a in model.adapters] == ["style"]

    plain = video(client)
    styled = video(client, adapters=[{"name": "style"}])
    assert styled != plain
    assert video(client, adapters=[{"name": "style", "scale": 0.8}]) == styled, "the deployed scale"
    assert video(client, adapters=[{"name": "style", "scale": 0.0}]) == plain

    gone = httpx.delete(f"{server.url}/v1/adapters/{TINY}/style", headers=AUTH)
    assert gone.status_code == 200 and gone.json()["deleted"] is True
    err = httpx.delete(f"{server.url}/v1/adapters/{TINY}/style", headers=AUTH)
    assert err.status_code == 404 and "serves no adapter 'style'" in err.json()["error"]["message"]


def test_bad_adapters_answer_400_naming_value_rule_and_fix(server, client, style, tmp_path):
    post(server, {"name": "style2", "path": style})
    for extra, words in [
        ({"adapters": [{"name": "nope"}]}, "adapter 'nope' is not served by this model"),
        ({"adapters": [{"name": "style2", "scale": 50}]}, "scale=50.0 is outside this model's range"),
    ]:
        response = httpx.post(
            f"{server.url}/v1/videos", json={"prompt": "x", **extra}, headers=AUTH, timeout=60
        )
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert words in error["message"] and "Fix:" in error["message"] and error["param"] == "adapters"
    (tmp_path / "lora.ckpt").write_bytes(b"\x80\x04")
    pickle = post(server, {"name": "bad", "path": str(tmp_path / "lora.ckpt")})
    assert pickle.status_code == 400 and "pickle file" in pickle.json()["error"]["message"]
    missing = post(server, {"name": "bad", "path": str(tmp_path / "none.safetensors")})
    assert missing.status_code == 400 and "does not exist" in missing.json()["error"]["message"]
    odd = post(server, {"name": "../x", "path": style})
    assert odd.status_code == 400 and odd.json()["error"]["param"] == "name"
    assert "bad" not in [a["name"] for a in client.models.list().data[0].adapters]
    assert video(client, adapters=[{"name": "style2"}]), "the server kept serving"
