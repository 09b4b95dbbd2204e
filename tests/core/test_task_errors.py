"""Asking a model for a task it lacks (or one that outputs something else) is refused before any work,
naming the model's tasks, what each outputs, and the fix: `fv chat` and the HTTP routes' pick_task."""

import pytest

from fv_core.cli import main
from fv_core.deploy.card import ModelDeploy
from fv_core.load import load
from fv_core.plugins import load_plugins
from fv_core.serving.errors import ApiError
from fv_core.serving.submission import ServedModel, pick_task


def _chat_error(argv, capsys):
    assert main(["chat", *argv, "hello"]) == 2
    out = capsys.readouterr()
    assert out.out == ""  # nothing generated, nothing printed before the refusal
    return out.err


def test_chat_with_a_video_task_is_refused_naming_the_tasks_and_the_fix(capsys):
    err = _chat_error(["--model", "wan2.1-t2v-tiny", "--task", "t2v"], capsys)
    assert "task 't2v' of 'wan2.1-t2v-tiny' outputs video, not text" in err
    assert "its tasks are t2v (video), t2i (image)" in err
    assert "Fix: chat with a model that has a text task (e.g. bagel-tiny" in err
    assert "`fv generate --model wan2.1-t2v-tiny --task t2v`" in err


def test_chat_with_a_video_model_and_no_task_names_its_tasks(capsys):
    err = _chat_error(["--model", "wan2.1-t2v-tiny"], capsys)
    assert "'wan2.1-t2v-tiny' has no task that answers in text" in err and "None" not in err
    assert "t2v (video), t2i (image)" in err


def test_chat_with_an_image_task_of_a_chat_model_points_to_its_text_task(capsys):
    err = _chat_error(["--model", "bagel-tiny", "--task", "t2i"], capsys)
    assert "task 't2i' of 'bagel-tiny' outputs image, not text" in err
    assert "chat (text), t2i (image)" in err and "Fix: chat with --task chat." in err


@pytest.fixture(scope="module")
def served():
    host = load_plugins()
    return {
        name: ServedModel(name, ModelDeploy(card=name), load(name, host=host), 0)
        for name in ("bagel-tiny", "wan2.1-t2v-tiny")
    }


def test_a_route_without_a_task_for_its_output_names_the_tasks_and_routes(served):
    with pytest.raises(ApiError) as info:
        pick_task(served["bagel-tiny"], None, "video")
    message = info.value.message
    assert "model 'bagel-tiny' has no video task; its tasks are chat (text), t2i (image)" in message
    assert "None" not in message
    assert "/v1/chat/completions or /v1/images/generations" in message
    assert (info.value.code, info.value.param) == ("unsupported_model", "model")


def test_a_task_of_another_output_names_the_tasks_that_fit(served):
    with pytest.raises(ApiError) as info:
        pick_task(served["wan2.1-t2v-tiny"], "t2i", "video")
    message = info.value.message
    assert "task 't2i' of model 'wan2.1-t2v-tiny' outputs image, not video" in message
    assert "Fix: ask for task 't2v', or leave task out." in message
    assert (info.value.code, info.value.param) == ("invalid_task", "task")
    with pytest.raises(ApiError, match="has no video task 'i2v'"):
        pick_task(served["wan2.1-t2v-tiny"], "i2v", "video")
    assert pick_task(served["wan2.1-t2v-tiny"], None, "video") == "t2v"
