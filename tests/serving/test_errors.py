"""Every error answer: 400/422 with value, rule and fix; 401; 404 listing models; 409; 429 with Retry-After."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest

from fv_core import ConfigError
from tests.serving.support import SMALL, TINY, wait_idle

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
AUTH = {"Authorization": "Bearer test-key"}


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


def test_bad_api_key_is_401(server):
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    err = error_of(httpx.get(f"{server.url}/v1/videos"), 401)
    assert err["code"] == "invalid_api_key" and "Authorization: Bearer" in err["message"]


def test_unknown_model_is_404_listing_models(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.videos.create(prompt="a cat", model="sora-2", **SMALL)
    assert TINY in info.value.message and "sora-2" in info.value.message
    with pytest.raises(openai.NotFoundError):
        client.images.generate(prompt="a cat", model="dall-e-3")


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"num_frames": 13}, "num_frames", ["num_frames=13", "max_frames=9", "Fix"]),
        ({"num_inference_steps": 500}, "num_inference_steps", ["500", "max_steps=200", "Fix"]),
        ({"guidance_scale": 25.0}, "guidance_scale", ["25.0", "max_guidance=20.0", "Fix"]),
        ({"seconds": 4}, "num_frames", ["num_frames=65", "max_frames=9"]),  # 4 s at 16 fps
    ],
)
def test_over_limit_is_400_with_value_rule_fix(server, extra, param, words):
    body = {"prompt": "a cat", "size": "32x32", **extra}
    err = error_of(httpx.post(f"{server.url}/v1/videos", json=body, headers=AUTH), 400)
    assert err["param"] == param and err["code"] == "limit_exceeded"
    assert all(w in err["message"] for w in words), err["message"]


def test_omitted_values_are_checked_as_the_card_defaults(server, monkeypatch):
    monkeypatch.setattr(server.service.deploy.limits, "max_frames", 3)  # the tiny card defaults to 5 frames
    body = {"prompt": "a cat", "size": "32x32"}
    err = error_of(httpx.post(f"{server.url}/v1/videos", json=body, headers=AUTH), 400)
    assert (
        err["param"] == "num_frames"
        and "num_frames=5 exceeds this deployment's limit max_frames=3" in err["message"]
    )


def test_size_over_limit_and_card_rules(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.videos.create(prompt="a cat", size="4096x32")
    assert "max_width=1280" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:  # the card's own rule, from its loop
        client.videos.create(prompt="a cat", size="32x32", extra_body={"num_frames": 6})
    assert "4k+1" in info.value.message and "Fix" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.videos.create(prompt="a cat", size="40x32", extra_body={"num_frames": 5})
    assert "multiple of 16" in info.value.message


def test_schema_violations_are_400_as_openai_answers_them(server, client):
    with pytest.raises(openai.BadRequestError) as info:
        client.videos.create(prompt="a cat", extra_body={"num_frame": 5})
    assert "num_frame" in info.value.message and "unknown field" in info.value.message
    for body in (
        {"prompt": ""},
        {"prompt": "x", "seed": -1},
        {"prompt": "x", "size": "big"},
        {"prompt": "x", "guidance_scale": "nan"},
        {"prompt": "x", "num_frames": True},  # a boolean is not a number
    ):
        err = error_of(httpx.post(f"{server.url}/v1/videos", json=body, headers=AUTH), 400)
        assert err["type"] == "invalid_request_error" and (
            "got" in err["message"] or "boolean" in err["message"]
        )
    huge = {"prompt": "x", "num_frames": 10**30}  # valid JSON, over the limit
    assert (
        error_of(httpx.post(f"{server.url}/v1/videos", json=huge, headers=AUTH), 400)["param"] == "num_frames"
    )
    err = error_of(httpx.get(f"{server.url}/v1/videos", params={"limit": 0}, headers=AUTH), 400)
    assert err["param"] == "limit"


def test_hostile_bodies_get_4xx_and_the_server_keeps_serving(server, client):
    post = lambda **kw: httpx.post(f"{server.url}/v1/videos", headers=AUTH, **kw)  # noqa: E731
    deep = "[" * 100_000 + "]" * 100_000  # past the parser's recursion limit
    assert error_of(post(content=deep.encode()), 400)["code"] == "invalid_json"
    nested = {"prompt": "x", "plugin_options": {"a": {"b": {"c": {"d": {"e": {"f": {"g": {}}}}}}}}}
    assert "nests deeper" in error_of(post(json=nested), 400)["message"]
    huge = b'{"prompt": "' + b"x" * (26 * 2**20) + b'"}'
    assert error_of(post(content=huge), 413)["code"] == "body_too_large"
    accepted = post(
        json={"prompt": "a cat", "user": "u1", "size": "32x32", "num_frames": 5, "num_inference_steps": 1}
    )
    assert accepted.status_code == 200 and accepted.headers["x-fv-ignored-fields"] == "user"
    assert client.models.list().data  # still serving


@pytest.mark.parametrize(
    ("content_type", "body"),
    [
        ("text/plain", b"prompt=a cat"),
        ("application/xml", b"<prompt>a cat</prompt>"),
        ("multipart/form-data", b"no boundary"),
        ("multipart/form-data; boundary=x", b"--x\r\nbroken"),
        ("application/json; charset=latin-1", '{"prompt": "caf\u00e9"}'.encode("latin-1")),
        ("application/json", b'{"prompt": "\\ud800 lone surrogate", "size": "-32x32"}'),
        ("application/json", b'{"prompt": "a", "num_frames": 0, "size": "32x32"}'),
        ("application/json", b'{"prompt": "a", "num_inference_steps": -1, "size": "32x32"}'),
        ("application/json", b'{"prompt": "a", "seconds": "-1"}'),
        ("application/json", b'{"prompt": "a", "size": "0x0"}'),
        ("application/json", b'{"prompt": "a", "guidance_scale": "high"}'),
        (
            "application/json",
            b'{"prompt": "a", "size": "32x32", "flow_shift": 5e-324}',
        ),  # found by the fuzz: NaN output
    ],
)
def test_bad_content_types_forms_and_values_are_400(server, content_type, body):
    response = httpx.post(
        f"{server.url}/v1/videos", content=body, headers={**AUTH, "content-type": content_type}
    )
    err = error_of(response, 400)
    assert err["message"] and "Fix" in err["message"]


def test_unicode_and_huge_ids_are_404(server):
    for bad in ("vid\u00e9o_\u00fc", "video_" + "\u00e9" * 32, "x" * 10_000, "video_%F0%9F%98%80"):
        assert httpx.get(f"{server.url}/v1/videos/{bad}", headers=AUTH).status_code == 404
        assert httpx.delete(f"{server.url}/v1/videos/{bad}", headers=AUTH).status_code == 404


def test_malformed_bodies_are_400(server):
    post = lambda **kw: httpx.post(f"{server.url}/v1/videos", headers=AUTH, **kw)  # noqa: E731
    assert error_of(post(content=b"{not json"), 400)["code"] == "invalid_json"
    assert error_of(post(json=[1, 2]), 400)["code"] == "invalid_json"
    form = {"prompt": "a cat", "plugin_options": "x", "plugin_options[a]": "y"}
    assert error_of(post(data=form), 400)["code"] == "invalid_body"


def test_plugin_options_pass_the_trust_boundary(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.videos.create(
            prompt="a cat", extra_body={"plugin_options": {"fv-cache-dit": {"threshold": 0.1}}}
        )
    assert "does not enable" in info.value.message


def test_input_reference_unsupported_is_400(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.videos.create(prompt="a cat", input_reference=("ref.png", b"\x89PNG...", "image/png"), **SMALL)
    assert info.value.body["param"] == "input_reference"


def test_unknown_video_ids_are_404_and_never_touch_files(server):
    for bad in ("video_0123", "../../etc/passwd", "..%2F..%2Fjobs.sqlite3", "video_" + "0" * 32, "%00"):
        for suffix in ("", "/content"):
            response = httpx.get(f"{server.url}/v1/videos/{bad}{suffix}", headers=AUTH)
            assert response.status_code == 404, (bad, suffix, response.text)
        assert httpx.delete(f"{server.url}/v1/videos/{bad}", headers=AUTH).status_code == 404


def test_content_of_unfinished_video_is_409(server, client):
    video = client.videos.create(
        prompt="a slow cat", size="32x32", extra_body={"num_frames": 5, "num_inference_steps": 100}
    )
    err = error_of(httpx.get(f"{server.url}/v1/videos/{video.id}/content", headers=AUTH), 409)
    assert err["code"] == "video_not_ready"
    client.videos.delete(video.id)
    wait_idle(server)


def test_full_queue_is_429_with_retry_after(server, client):
    slow = {"size": "32x32", "extra_body": {"num_frames": 9, "num_inference_steps": 200}}
    ids = []
    try:
        with pytest.raises(openai.RateLimitError) as info:
            for _ in range(10):  # 2 running + 4 waiting fit (submit does not wait for the engine)
                ids.append(client.videos.create(prompt="a queue", **slow).id)
        assert len(ids) == 6
        assert int(info.value.response.headers["Retry-After"]) >= 1
        assert "retry after" in info.value.message
        metrics = httpx.get(f"{server.url}/metrics").text
        assert 'fv_admission_refusals_total{reason="queue_full"}' in metrics
    finally:
        for i in ids:
            client.videos.delete(i)
        wait_idle(server)


def test_unknown_route_and_method(server):
    assert error_of(httpx.get(f"{server.url}/v1/nothing", headers=AUTH), 404)["code"] == "not_found"
    put = httpx.put(f"{server.url}/v1/videos", headers=AUTH)
    assert error_of(put, 405)["code"] == "method_not_allowed" and put.headers["allow"] == "GET, OPTIONS, POST"
    for path, allow in (
        ("/v1/videos/video_x", "DELETE, GET, OPTIONS"),
        ("/v1/images/generations", "OPTIONS, POST"),
    ):
        options = httpx.options(f"{server.url}{path}", headers=AUTH)
        assert options.status_code == 204 and options.headers["allow"] == allow


def test_uploaded_references_decode_to_image_parts():
    from fv_core.request import image_part
    from fv_core.serving.media import encode_png

    frame = np.random.default_rng(0).random((18, 24, 3)).astype(np.float32)
    image = image_part(encode_png(frame)).image
    assert image.shape == (18, 24, 3) and np.abs(image - frame).max() <= 0.5 / 255 + 1e-6
    with pytest.raises(ConfigError, match="not a readable image"):
        image_part(b"\x89PNG...")


def test_every_answer_carries_a_request_id(server):
    mine = httpx.get(f"{server.url}/v1/models", headers={**AUTH, "x-request-id": "trace-42"})
    assert mine.headers["x-request-id"] == "trace-42"
    fresh = httpx.get(f"{server.url}/v1/videos/nope", headers=AUTH)
    assert fresh.status_code == 404 and len(fresh.headers["x-request-id"]) == 32
    body = {"prompt": "traced", "size": "32x32", "num_frames": 5, "num_inference_steps": 1}
    job = httpx.post(
        f"{server.url}/v1/videos", json=body, headers={**AUTH, "x-request-id": "trace-43"}
    ).json()
    assert server.service.store.request_id(job["id"]) == "trace-43"  # the job record names its request
    wait_idle(server)
