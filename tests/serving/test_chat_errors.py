"""Chat with a model that has no text task: a 400 naming its tasks and the fix, before anything is queued."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.serving.support import TINY

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_chat_with_a_video_model_names_its_tasks_and_the_fix(server, client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=TINY, messages=[{"role": "user", "content": "hello"}])
    message = info.value.message
    assert f"model {TINY!r} cannot chat" in message
    assert "t2v (video)" in message and "t2i (image)" in message  # the tasks and what they output
    assert "Fix: chat with a model that has a text task (e.g. bagel-tiny" in message
    assert "/v1/videos" in message and "None" not in message

    answer = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"model": TINY, "messages": [{"role": "user", "content": "hi"}], "stream": True},
        headers={"Authorization": "Bearer test-key"},
    )
    assert answer.status_code == 400, answer.text  # streamed too: an error, not an empty stream
    error = answer.json()["error"]
    assert (error["code"], error["param"]) == ("unsupported_model", "model")
