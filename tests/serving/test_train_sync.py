"""A training run pushes its weights into a live ``fv serve`` (the config's ``sync:`` section): each
push lands as ``<method>-step-<N>`` and the server then runs exactly the student's weights."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from fv_core import ConfigError
from fv_core.training import (
    Consistency,
    MethodSpec,
    Role,
    RoleSpec,
    train,
    train_adapter,
    validate,
)
from tests.serving.support import TINY, ServerThread, tiny_deploy

KEY = "trainer-key"


class VelocityRegression:
    """A student copy of the served transformer, regressed through the serve loop's own body onto a
    fixed target: its weights change every step."""

    spec = MethodSpec(
        roles=(RoleSpec(Role.STUDENT, trains=("transformer",), holds=("transformer",)),),
        consistency=Consistency.C2_FREE,
    )

    def __init__(self, loaded) -> None:
        self.adapter = train_adapter(loaded, num_frames=5, height=32, width=32)
        student = copy.deepcopy(self.adapter.module("transformer")).requires_grad_(True)
        self.roles = {Role.STUDENT: {"transformer": student}}
        self.opt = torch.optim.SGD(student.parameters(), lr=0.05)
        gen = torch.Generator().manual_seed(0)
        self.latents = self.adapter.noise(1, gen)
        self.embeds = self.adapter.conditioning(["a red circle moving left"])

    def step(self, step: int) -> dict[str, float]:
        student = self.roles[Role.STUDENT]["transformer"]
        velocity = self.adapter.velocity(student, self.latents, torch.tensor([0.5]), self.embeds, train=True)
        loss = (velocity - 1.0).pow(2).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return {"loss": loss.item()}

    def evaluate(self, step: int) -> dict[str, float]:
        return {}

    def save(self, folder) -> None:
        folder.mkdir(parents=True, exist_ok=True)

    def load(self, folder) -> None:
        return None

    def export(self, folder) -> None:
        folder.mkdir(parents=True, exist_ok=True)


@pytest.fixture(scope="module")
def srv(host, tmp_path_factory):
    deploy = tiny_deploy(tmp_path_factory.mktemp("train-sync"), max_frames=9, max_steps=50)
    with ServerThread(deploy, host, api_key=KEY) as server:
        yield server


def test_training_pushes_the_student_into_the_server(srv, tmp_path, monkeypatch):
    loaded = srv.service.models[TINY].loaded
    method = VelocityRegression(loaded)
    before = {k: v.clone() for k, v in loaded.instance.component("transformer").state_dict().items()}
    monkeypatch.setenv("FV_TEST_KEY", KEY)
    cfg = validate({
        "method": "velocity", "output_dir": str(tmp_path), "steps": 2, "log_every": 1, "checkpoint_every": 10,
        "sync": {"url": srv.url, "every": 1, "api_key_env": "FV_TEST_KEY"},
    })  # fmt: skip
    train(cfg, method, progress=False)
    pushes = [r for r in map(json.loads, (tmp_path / "log.jsonl").read_text().splitlines()) if "sync" in r]
    assert [p["step"] for p in pushes] == [1, 2]
    assert pushes[-1]["sync"]["versions"]["transformer"] == "velocity-step-2"
    served = loaded.instance.component("transformer").state_dict()
    student = method.roles[Role.STUDENT]["transformer"].state_dict()
    assert all(torch.equal(served[k], student[k]) for k in student)
    assert not all(torch.equal(served[k], before[k]) for k in before)


def test_a_refused_push_stops_training_with_the_servers_reason(srv, tmp_path):
    method = VelocityRegression(srv.service.models[TINY].loaded)
    cfg = validate({
        "method": "velocity", "output_dir": str(tmp_path), "steps": 1,
        "sync": {"url": srv.url, "every": 1, "api_key_env": None},
    })  # fmt: skip
    with pytest.raises(ConfigError, match="HTTP 401"):
        train(cfg, method, progress=False)
    ema = validate({**cfg.model_dump(mode="json"), "sync": {"url": srv.url, "every": 1, "role": "ema"}})
    with pytest.raises(ConfigError, match=r"sync.role='ema'.*holds \{'student': \['transformer'\]\}.*Fix"):
        train(ema, method, progress=False)
