"""Cross-model workflows (examples/deploy/workflows.yaml): a workflow equals its stages run by hand,
bit for bit (fan-out and select included), every validation error names the stage, the binding and the
fix, and ``fv generate --model WORKFLOW`` writes the last stage's artifact with a nested provenance."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import fv_core
from fv_core import ConfigError
from fv_core.deploy import load_deploy
from fv_core.deploy.check import check_deploy
from fv_core.extend import hookimpl
from fv_core.plugins import load_plugins
from fv_core.runtime import Engine

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "deploy" / "workflows.yaml"


@pytest.fixture(scope="module")
def host():
    return load_plugins(env={"FV_PLUGINS": "fv-wan,fv-bagel,fv-ltx2,fv-train-flow"})


@pytest.fixture(scope="module")
def plan():
    return load_deploy(EXAMPLE)


def test_t2i_to_i2v_equals_its_stages_by_hand(host, plan):
    flow = fv_core.load("t2i-to-i2v", deploy=plan, host=host)
    with torch.no_grad():
        out = flow.generate(prompt="a lantern on a table", seed=3, num_frames=5)
        t2i, i2v = flow.models["wan-t2i"], flow.models["wan-i2v"]
        still = t2i.generate(task="t2i", prompt="a lantern on a table", seed=3)
        by_hand = i2v.generate(
            task="i2v", image=still.image, prompt="a lantern on a table", seed=3, num_frames=5
        )
    assert np.array_equal(out.frames, by_hand.frames)
    prov = out.provenance
    assert prov["workflow"] == "t2i-to-i2v" and list(prov["stages"]) == ["still", "motion"]
    assert prov["stages"]["still"]["card"] == "wan2.1-t2v-tiny" and prov["stages"]["motion"]["task"] == "i2v"
    with pytest.raises(ConfigError, match=r"request to workflow 't2i-to-i2v'.*prompt"):
        flow.generate(seed=1)


def test_best_of_n_keeps_the_candidate_the_detector_scores_best(host, plan):
    """fv-train-flow registers shapes-best-of-n (fv_register_workflows) on the card wan2.1-t2v-shapes; the
    example deploy serves it on its model named "shapes", and fv_core.load serves it alone too."""
    flow = fv_core.load("shapes-best-of-n", deploy=plan, host=host)
    assert flow.spec.stages[0].model == "shapes"
    shapes, reward = flow.models["shapes"], flow.scorers["candidates"]
    prompt = "a red circle moving left"
    with torch.no_grad():
        out = flow.generate(prompt=prompt, seed=10, num_inference_steps=6)
        requests = [
            shapes.prepare(
                {"prompt": prompt, "seed": 10 + i, "guidance_scale": 4.0, "num_inference_steps": 6},
                task="t2v",
            )
            for i in range(4)
        ]
        results = Engine().run_batched([shapes.job(r) for r in requests])
    frames = torch.stack([r.outputs["frames"] for r in results])
    scores = reward(frames, [prompt] * 4).tolist()
    best = int(np.argmax(scores))
    prov = out.provenance["stages"]["candidates"]
    assert [c["score"] for c in prov["candidates"]] == pytest.approx(scores) and prov["selected"] == best
    assert np.array_equal(out.frames, results[best].outputs["frames"].numpy())
    alone = fv_core.load("shapes-best-of-n", host=host)  # no deploy: the cards it names, served alone
    assert list(alone.models) == ["wan2.1-t2v-shapes"] and alone.deploy["plugins"] == [
        "fv-train-flow",
        "fv-wan",
    ]


@pytest.mark.parametrize(
    ("workflow", "words"),
    [
        (
            "shapes-best-of-n",
            r"runs the card 'wan2.1-t2v-shapes' in its stage 'candidates'.*Fix: add \{card: wan2",
        ),
        ("nope", r"unknown workflows key 'nope'. Available: .*shapes-best-of-n"),
    ],
)
def test_registered_workflows_need_their_cards_served(host, workflow, words):
    import re

    deploy = load_deploy_data(
        {
            "plugins": ["fv-wan", "fv-train-flow"],
            "models": [{"card": "wan2.1-t2v-tiny"}],
            "workflows": {"w": workflow},
        }
    )
    problems = check_deploy(deploy, host)
    assert any(re.search(words, p) for p in problems), problems


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"model": "nope"}, r"stages\[1\] \('motion'\): model 'nope' is not served .*Fix: add it"),
        (
            {"task": "t2v", "model": "wan-t2i"},
            r"bind\.image: the stage's task takes no image .*Fix: use a task",
        ),
        (
            {"bind": {"prompt": "request.style"}},
            r"bind\.prompt: request\.style is not a param of the workflow",
        ),
        ({"bind": {"image": "motion.image"}}, r"bind\.image: motion\.image names no earlier stage's output"),
        ({"bind": {"cfg": "request.prompt"}}, r"bind\.cfg: cfg is not a param of the stage's task"),
        ({"fan_out": 2}, r"fan_out=2 with select=None; .*Fix: set both"),
        ({"fan_out": 2, "select": "beauty"}, r"select: no loaded plugin registers the scorer 'beauty'"),
        (
            {"fan_out": 2, "select": {"scorer": "beauty", "options": {}}},
            r"select: no loaded plugin registers the scorer 'beauty'",
        ),
    ],
)
def test_validation_names_the_stage_binding_and_fix(host, plan, change, words):
    import re

    data = plan.model_dump(mode="json")
    motion = data["workflows"]["t2i-to-i2v"]["stages"][1]
    motion.update(change)
    if "bind" in change:
        motion["bind"] = {"image": "still.image", "prompt": "request.prompt", **change["bind"]}
    problems = check_deploy(load_deploy_data(data), host)
    assert any(re.search(words, p) for p in problems), problems


def load_deploy_data(data):
    from fv_core.deploy.card import parse_deploy

    return parse_deploy(data)


def test_fv_generate_runs_a_workflow_and_keeps_its_provenance(tmp_path, capsys):
    from fv_core.cli import main

    out = tmp_path / "lantern.mp4"
    code = main(
        ["generate", "--model", "t2i-to-i2v", "--deploy", str(EXAMPLE), "--prompt", "a lantern",
         "--num-frames", "5", "-o", str(out)]
    )  # fmt: skip
    assert code == 0 and out.is_file()
    shown = capsys.readouterr().err  # progress per stage (plain lines off a terminal)
    assert (
        "t2i-to-i2v stage 1/2 still: wan-t2i t2i" in shown
        and "t2i-to-i2v stage 2/2 motion: wan-i2v i2v 1/" in shown
    )
    prov = json.loads(out.with_suffix(".json").read_text())
    assert prov["workflow"] == "t2i-to-i2v" and prov["params"]["num_frames"] == 5
    again = tmp_path / "again.mp4"
    assert main(["generate", "--replay", str(out.with_suffix(".json")), "-o", str(again)]) == 0
    assert again.read_bytes() == out.read_bytes()


def test_workflows_served_by_id_through_the_openai_sdk(host, plan, tmp_path):
    """A workflow id on /v1/videos (t2i-to-i2v) and /v1/images (a one-stage image workflow), listed in
    /v1/models; bad params answer 400. Interleave gate: a workflow and direct requests to its stages' models,
    all at once, each equal to its run alone (bitwise mode)."""
    import io
    import zipfile

    import httpx
    import openai

    from fv_core.deploy.card import parse_deploy
    from tests.serving.support import ServerThread, wait_idle

    data = plan.model_dump(mode="json")
    data["models"] = [m for m in data["models"] if m["name"] in ("wan-t2i", "wan-i2v")]
    data["workflows"] = {
        "t2i-to-i2v": {**data["workflows"]["t2i-to-i2v"], "keep": "all"},  # its still downloadable too
        "still": {"params": {"prompt": None, "seed": 0}, "stages": [
            {"name": "still", "model": "wan-t2i", "task": "t2i", "bind": {"prompt": "request.prompt", "seed": "request.seed"}}
        ]},
    }  # fmt: skip
    data["data_dir"], data["determinism"] = str(tmp_path), "bitwise"
    deploy = parse_deploy(data)
    with ServerThread(deploy, host) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)
        listed = {m.id: m for m in client.models.list().data}
        assert listed["t2i-to-i2v"].workflow and not listed["wan-t2i"].workflow
        started = client.videos.create(
            prompt="a lantern", model="t2i-to-i2v", extra_body={"seed": 4, "num_frames": 5}
        )
        direct = client.videos.create(
            prompt="a lantern", model="wan-t2i", extra_body={"seed": 4, "num_frames": 5}
        )
        done = client.videos.poll(started.id, poll_interval_ms=20)
        assert done.status == "completed", done.error
        assert client.videos.poll(direct.id, poll_interval_ms=20).status == "completed"
        mp4 = server.service.store.video_path(done.id)
        served, served_bytes = json.loads(mp4.with_suffix(".json").read_text()), mp4.read_bytes()
        direct_bytes = server.service.store.video_path(direct.id).read_bytes()
        kept = httpx.get(f"{server.url}/v1/videos/{done.id}/content", params={"variant": "stages"})
        with zipfile.ZipFile(io.BytesIO(kept.content)) as archive:
            assert sorted(archive.namelist()) == ["motion.json", "motion.mp4", "still.json", "still.png"]
            assert archive.read("motion.mp4") == served_bytes
        none = httpx.get(f"{server.url}/v1/videos/{direct.id}/content", params={"variant": "stages"})
        assert none.status_code == 404 and "keep: all" in none.json()["error"]["message"]
        images = client.images.generate(prompt="a lantern", model="still", n=2, extra_body={"seed": 4})
        assert len(images.data) == 2 and images.data[0].b64_json != images.data[1].b64_json
        with pytest.raises(
            openai.BadRequestError, match="takes the params .*also sets \\['guidance_scale'\\]"
        ):
            client.videos.create(prompt="x", model="t2i-to-i2v", extra_body={"guidance_scale": 2.0})
        failed = client.videos.create_and_poll(
            prompt="x", model="t2i-to-i2v", poll_interval_ms=20, extra_body={"num_frames": 6}
        )  # the still is made; the i2v stage refuses 6 frames
        assert failed.status == "failed" and "workflow 't2i-to-i2v'" in failed.error.message
        assert (
            "stage 2/2 motion (wan-i2v i2v)" in failed.error.message and "num_frames" in failed.error.message
        )
        gone = client.videos.create(prompt="x", model="t2i-to-i2v", extra_body={"num_frames": 5})
        client.videos.delete(gone.id)  # cancels the stage running
        wait_idle(server)
        assert server.service.engine.engine.admission.running == {}
    flow = fv_core.load("t2i-to-i2v", deploy=deploy, host=host)
    with torch.no_grad():
        alone = flow.generate(prompt="a lantern", seed=4, num_frames=5)
    assert served["params"] == alone.provenance["params"] and list(served["stages"]) == ["still", "motion"]
    assert alone.save(tmp_path / "alone.mp4").read_bytes() == served_bytes
    with torch.no_grad():
        solo = flow.models["wan-t2i"].generate(prompt="a lantern", seed=4, num_frames=5)
    assert solo.save(tmp_path / "solo.mp4").read_bytes() == direct_bytes


def brightest(frames: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    return frames.mean(dim=(1, 2, 3, 4))


@hookimpl
def fv_register_scorers(register):
    register("brightest", lambda **options: brightest)


@hookimpl
def fv_register_workflows(register):
    still = {
        "model": "wan2.1-t2v-tiny",
        "task": "t2i",
        "bind": {"prompt": "request.prompt", "seed": "request.seed"},
    }
    register(
        "brightest-still",
        lambda: {"params": {"prompt": None, "seed": 0}, "stages": [{"name": "still", **still, "fan_out": 2, "select": "brightest"}]},
    )  # fmt: skip


def test_a_plugin_registers_a_scorer_and_a_workflow_on_its_cards():
    """fv_register_scorers and fv_register_workflows: the workflow loads alone on the card it names and keeps
    the brighter of its two candidates."""
    import types

    host = load_plugins(env={"FV_PLUGINS": "fv-wan"})
    host.add(
        types.SimpleNamespace(
            fv_register_scorers=fv_register_scorers, fv_register_workflows=fv_register_workflows
        ),
        "fv-bright",
    )
    host.collect()
    flow = fv_core.load("brightest-still", host=host)
    with torch.no_grad():
        out = flow.generate(prompt="a lantern", seed=1)
    stage = out.provenance["stages"]["still"]
    scores = [c["score"] for c in stage["candidates"]]
    assert stage["selected"] == int(np.argmax(scores)) and len(set(scores)) == 2
    assert out.image.mean() == pytest.approx(max(scores), rel=1e-5)
