"""BAGEL behind the OpenAI-compatible server, driven by the official ``openai`` client: chat completions
(streamed and not, images as data URLs, usage), image generation with ``think`` (the thinking comes back
as ``revised_prompt``), image edits, and bad input answered 4xx; plus ``fv chat``."""

from __future__ import annotations

import base64
import io

import numpy as np
import openai
import pytest
from PIL import Image

from fv_core.deploy.card import parse_deploy
from tests.serving.support import ServerThread

KEY = "k"


def png(width: int = 40, height: int = 32) -> bytes:
    pixels = (np.random.default_rng(0).random((height, width, 3)) * 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def client(bagel_host, bagel_path, tmp_path_factory):
    deploy = parse_deploy(
        {
            "plugins": ["fv-bagel"],
            "models": [{"card": "bagel-tiny", "weights": bagel_path}],
            "data_dir": str(tmp_path_factory.mktemp("data")),
        }
    )
    with ServerThread(deploy, bagel_host, api_key=KEY) as server:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


def ask(**extra):
    return dict(model="bagel-tiny", messages=[{"role": "user", "content": "describe a cat"}], **extra)


def test_chat_completion_equals_the_front_door(client, bagel):
    answer = client.chat.completions.create(**ask(max_tokens=5, seed=3))
    want = bagel.generate(task="chat", prompt="describe a cat", max_tokens=5, seed=3)
    choice = answer.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == want.text
    metrics = want.provenance["metrics"]
    assert answer.usage.completion_tokens == metrics["completion_tokens"]
    assert answer.usage.prompt_tokens == metrics["prompt_tokens"]
    assert answer.usage.total_tokens == metrics["prompt_tokens"] + metrics["completion_tokens"]
    assert choice.finish_reason == ("length" if metrics["stop_reason"] == "max_tokens" else "stop")


def test_streamed_chunks_add_up_to_the_answer(client):
    whole = client.chat.completions.create(**ask(max_tokens=8, temperature=0.8, seed=5))
    chunks = list(
        client.chat.completions.create(
            **ask(max_tokens=8, temperature=0.8, seed=5), stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finished = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finished == [whole.choices[0].finish_reason]
    assert chunks[-1].usage == whole.usage and not chunks[-1].choices
    assert len({c.id for c in chunks}) == 1


def test_images_and_earlier_turns_reach_the_model(client, bagel):
    """OpenAI's [question, image] message: the image goes before the question, as the front door takes it."""
    from fv_core.request import TextPart, image_part

    messages = [
        {"role": "system", "content": "answer briefly"},
        {"role": "user", "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": data_url(png())}},
        ]},
    ]  # fmt: skip
    answer = client.chat.completions.create(model="bagel-tiny", messages=messages, max_tokens=4, seed=1)
    parts = [TextPart("answer briefly"), image_part(png())]
    want = bagel.generate(task="chat", parts=parts, prompt="what is this?", max_tokens=4, seed=1)
    assert answer.choices[0].message.content == want.text
    assert answer.usage.prompt_tokens == want.provenance["metrics"]["prompt_tokens"]


def test_images_generations_with_think_returns_the_thinking(client, bagel):
    extra = {"num_inference_steps": 3, "seed": 4}
    plain = client.images.generate(model="bagel-tiny", prompt="a red cat", size="64x64", extra_body=extra)
    thought = client.images.generate(
        model="bagel-tiny",
        prompt="a red cat",
        size="64x64",
        extra_body={**extra, "think": True, "max_tokens": 4},
    )
    want = bagel.generate(task="think-t2i", prompt="a red cat", num_inference_steps=3, max_tokens=4, seed=4)
    assert plain.data[0].revised_prompt is None
    assert thought.data[0].revised_prompt == want.text.text
    image = np.asarray(Image.open(io.BytesIO(base64.b64decode(thought.data[0].b64_json))))
    assert image.shape == (64, 64, 3)
    assert np.array_equal(image, np.asarray(Image.open(io.BytesIO(_png_of(want.image)))))


def _png_of(image: np.ndarray) -> bytes:
    from fv_core.serving.media import encode_png

    return encode_png(image)


def test_image_edit_through_the_sdk(client, bagel):
    from fv_core.request import image_part

    edited = client.images.edit(
        model="bagel-tiny", image=("in.png", png(), "image/png"), prompt="make it blue",
        extra_body={"num_inference_steps": 3, "seed": 2},
    )  # fmt: skip
    want = bagel.generate(
        task="edit", parts=[image_part(png())], prompt="make it blue", num_inference_steps=3, seed=2
    )
    got = np.asarray(Image.open(io.BytesIO(base64.b64decode(edited.data[0].b64_json))))
    assert np.array_equal(got, np.asarray(Image.open(io.BytesIO(_png_of(want.image)))))


@pytest.mark.parametrize(
    ("request_kwargs", "words"),
    [
        (ask(stop=5), "stop"),
        (ask(n=2), "n"),
        (ask(logprobs=True), "logprobs"),
        (dict(model="bagel-tiny", messages=[{"role": "assistant", "content": "hi"}]), "user"),
        (dict(model="bagel-tiny", messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
            {"type": "text", "text": "what?"}]}]), "data URL"),
        (dict(model="bagel-tiny", messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(b"not an image")}},
            {"type": "text", "text": "what?"}]}]), "not a readable image"),
        (dict(model="bagel-tiny", messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(png(9000, 16))}},
            {"type": "text", "text": "what?"}]}]), "8192"),
        (ask(max_tokens=10**6), "max_tokens"),
        (dict(model="bagel-tiny", messages=[{"role": "user", "content": "cat " * 4000}], max_tokens=4), "positions"),
    ],
)  # fmt: skip
def test_bad_chat_input_is_a_4xx_naming_it(client, request_kwargs, words):
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(**request_kwargs, stream=stream)
        assert words in caught.value.message, caught.value.message


def test_bad_image_input_is_a_4xx_naming_it(client):
    with pytest.raises(openai.BadRequestError, match="not a readable image"):
        client.images.edit(model="bagel-tiny", image=("in.png", b"garbage", "image/png"), prompt="blue")
    with pytest.raises(openai.BadRequestError, match="mask"):
        client.images.edit(
            model="bagel-tiny",
            image=("in.png", png(), "image/png"),
            mask=("m.png", png(), "image/png"),
            prompt="x",
        )
    with pytest.raises(openai.BadRequestError, match="size"):
        client.images.edit(
            model="bagel-tiny", image=("in.png", png(), "image/png"), prompt="x", size="256x256"
        )
    with pytest.raises(openai.BadRequestError, match="max_tokens"):  # t2i has no thinking to bound
        client.images.generate(model="bagel-tiny", prompt="a cat", extra_body={"max_tokens": 3})


def test_fv_chat_streams_answers_and_keeps_the_conversation(
    bagel_host, bagel_path, bagel, monkeypatch, capsys
):
    from fv_core.cli import main
    from fv_core.request import TextPart

    monkeypatch.setattr("fv_core.plugins.load_plugins", lambda: bagel_host)
    base = ["chat", "--model", "bagel-tiny", "--weights", bagel_path, "--max-tokens", "4", "--seed", "1"]
    assert main([*base, "hello"]) == 0
    first = bagel.generate(task="chat", prompt="hello", max_tokens=4, seed=1).text
    assert capsys.readouterr().out == first + "\n"
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n\nand then?\n"))
    assert main(base) == 0
    second = bagel.generate(
        task="chat", parts=[TextPart("hello"), TextPart(first)], prompt="and then?", max_tokens=4, seed=1
    ).text
    assert capsys.readouterr().out == f"{first}\n{second}\n"


def test_a_client_that_leaves_mid_stream_cancels_its_request(client):
    import time

    import httpx

    headers = {"Authorization": f"Bearer {KEY}"}
    body = {**ask(max_tokens=2000, temperature=1.0, seed=0), "stream": True}
    url = f"{client.base_url}chat/completions"
    with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as response:
        assert response.status_code == 200
        next(response.iter_lines())  # the first chunk, then the client goes away
    cancelled = 'fv_jobs_total{model="bagel-tiny",status="cancelled"} 1.0'
    deadline = time.monotonic() + 30
    while cancelled not in httpx.get(url.replace("/v1/chat/completions", "/metrics")).text:
        assert time.monotonic() < deadline, "the abandoned request was not cancelled"
        time.sleep(0.1)

    def steps() -> str:
        text = httpx.get(url.replace("/v1/chat/completions", "/metrics")).text
        return next(line for line in text.splitlines() if line.startswith("fv_steps_total"))

    before = steps()
    time.sleep(1.0)
    assert steps() == before  # the engine stopped decoding it
