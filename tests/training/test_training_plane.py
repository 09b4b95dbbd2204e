"""The core training plane: the trainer's resume (RNG included), method specs, family adapters and
reward registration, and ``fv train`` in the core CLI."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch

import fv_core
from fv_core import ConfigError
from fv_core.cli import main
from fv_core.errors import UnknownKeyError
from fv_core.extend import hookimpl
from fv_core.plugins import PluginHost
from fv_core.training import (
    Consistency,
    MethodSpec,
    Role,
    RoleSpec,
    adapter_class,
    load_dataset,
    load_reward,
    train,
    train_adapter,
    validate,
)


class NoisyRegression:
    """A method that draws its batches from torch's global RNG: resume is exact only if the trainer
    restores that RNG."""

    spec = MethodSpec(
        roles=(RoleSpec(Role.STUDENT, trains=("w",), holds=("w",)),), consistency=Consistency.C1
    )

    def __init__(self, cfg) -> None:
        self.w = torch.zeros(3, requires_grad=True)
        self.opt = torch.optim.SGD([self.w], lr=0.1)
        self.roles: dict = {}

    def step(self, step: int) -> dict[str, float]:
        x = torch.randn(8, 3)
        loss = ((x @ self.w - x.sum(1)) ** 2).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return {"loss": loss.item()}

    def evaluate(self, step: int) -> dict[str, float]:
        return {"w_error": (self.w - 1).abs().sum().item()}

    def save(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        from safetensors.torch import save_file

        save_file({"w": self.w.detach().clone()}, str(folder / "w.safetensors"))

    def load(self, folder: Path) -> None:
        from safetensors.torch import load_file

        with torch.no_grad():
            self.w.copy_(load_file(str(folder / "w.safetensors"))["w"])

    def export(self, folder: Path) -> None:
        self.save(folder)


def _cfg(out: Path, steps: int) -> dict:
    return {"method": "toy", "output_dir": str(out), "steps": steps, "log_every": 1, "checkpoint_every": 3}


def test_resume_restores_the_global_rng(tmp_path):
    torch.manual_seed(0)
    full = NoisyRegression(None)
    train(validate(_cfg(tmp_path / "full", 6)), full, progress=False)
    torch.manual_seed(0)
    part = NoisyRegression(None)
    train(validate(_cfg(tmp_path / "part", 3)), part, progress=False)
    torch.manual_seed(123)  # a different process state: only the checkpoint's RNG gives the same batches
    resumed = NoisyRegression(None)
    summary = train(validate(_cfg(tmp_path / "part", 6)), resumed, progress=False)
    assert summary["resumed_from"] == 3
    assert summary["spec"]["roles"] == {"student": {"holds": ["w"], "trains": ["w"]}}
    assert torch.equal(resumed.w, full.w)


class ToyAdapter:
    def __init__(self, model, **defaults):
        self.model, self.defaults = model, defaults


def brightness(frames: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    return frames.mean(dim=(1, 2, 3, 4))


@hookimpl
def fv_register_trainers(register):
    register("toy", ToyAdapter)


@hookimpl
def fv_register_rewards(register):
    register("brightness", lambda: brightness)


class Stripes:
    """Clip ``index`` of any seed: a video whose every value is ``index``, captioned with it."""

    def batch(self, seed: int, index: int, size: int) -> tuple[torch.Tensor, list[str]]:
        values = torch.arange(index, index + size, dtype=torch.float32)
        return values.view(-1, 1, 1, 1, 1).expand(size, 3, 1, 2, 2), [
            f"clip {i}" for i in range(index, index + size)
        ]


@hookimpl
def fv_register_datasets(register):
    register("stripes", Stripes)


def test_adapter_reward_and_dataset_registration_through_hooks():
    host = PluginHost({})
    hooks = {
        "fv_register_trainers": fv_register_trainers,
        "fv_register_rewards": fv_register_rewards,
        "fv_register_datasets": fv_register_datasets,
    }
    host.add(types.SimpleNamespace(**hooks), "fv-toy")
    host.collect()
    assert adapter_class("toy", host) is ToyAdapter
    model = types.SimpleNamespace(card=types.SimpleNamespace(family="toy"))
    adapter = train_adapter(model, host, max_sequence_length=4)  # type: ignore[arg-type]
    assert adapter.model is model and adapter.defaults == {"max_sequence_length": 4}
    reward = load_reward("brightness", host)
    assert reward(torch.ones(2, 1, 2, 2, 3), ["a", "b"]).tolist() == [1.0, 1.0]
    video, captions = load_dataset("stripes", host).batch(0, 3, 2)
    assert video.shape == (2, 3, 1, 2, 2) and video[:, 0, 0, 0, 0].tolist() == [3.0, 4.0]
    assert captions == ["clip 3", "clip 4"]
    with pytest.raises(UnknownKeyError, match="unknown datasets key 'bogus'. Available: 'stripes'.*Fix"):
        load_dataset("bogus", host)
    with pytest.raises(ConfigError, match=r"family 'ltx2' has no training adapter.*\['toy'\].*Fix:"):
        adapter_class("ltx2", host)


@pytest.fixture(scope="module")
def shapes():
    return fv_core.load("wan2.1-t2v-shapes")


def test_wan_adapter_forward_is_the_serve_forward(shapes, tmp_path):
    """C2 on the adapter: the train-profile velocity equals the serve-profile one bit for bit, and only
    the train one carries a graph; an export is a loadable checkpoint naming its recipe."""
    adapter = train_adapter(shapes)
    gen = torch.Generator().manual_seed(0)
    latents = adapter.noise(2, gen)
    sigma = torch.tensor([0.3, 0.9])
    embeds = adapter.conditioning(["a red circle moving left", "a blue square moving up"])
    student = adapter.module("transformer")
    student.requires_grad_(True)
    try:
        served = adapter.velocity(student, latents, sigma, embeds)
        trained = adapter.velocity(student, latents, sigma, embeds, train=True)
    finally:
        student.requires_grad_(False)
    assert trained.requires_grad and not served.requires_grad
    assert torch.equal(trained.detach(), served)
    other = adapter.velocity(student, latents, sigma.flip(0), embeds)
    assert not torch.equal(other, served)  # the noise level reaches the forward

    adapter.export(tmp_path / "copy", {"transformer": student}, {"method": "test", "parents": ["shapes"]})
    assert json.loads((tmp_path / "copy" / "fv_recipe.json").read_text())["method"] == "test"
    copy = train_adapter(fv_core.load("wan2.1-t2v-shapes", tmp_path / "copy"))
    assert torch.equal(copy.velocity(copy.module("transformer"), latents, sigma, embeds), served)


def test_wan_adapter_refuses_image_and_two_expert_cards():
    model = fv_core.load("wan2.1-i2v-tiny")
    with pytest.raises(ConfigError, match="text-to-video.*Fix:"):
        train_adapter(model)


def test_fv_train_describe_prints_the_method_spec(tmp_path, capsys):
    config = tmp_path / "flow.yaml"
    config.write_text(f"method: flow\noutput_dir: {tmp_path}\nsteps: 1\n")
    assert main(["train", str(config), "--describe"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["consistency"] == "C1"
    assert spec["roles"]["student"]["trains"] == ["transformer", "text_encoder"]


def test_export_of_a_student_sharing_its_parents_files_is_self_contained(tmp_path):
    """The NFT card ships only its transformer and points at the parent's other folders; an export
    from it copies those in (no relative links left), and loads by path alone."""
    adapter = train_adapter(fv_core.load("wan2.1-t2v-shapes-nft"))
    adapter.export(tmp_path / "out", {}, {"method": "test"})
    index = json.loads((tmp_path / "out" / "model_index.json").read_text())
    assert "_fv_shared" not in index
    assert {"vae", "text_encoder", "tokenizer", "scheduler", "transformer"} <= {
        p.name for p in (tmp_path / "out").iterdir()
    }
    # by path alone the card pads prompts as Wan's pipeline does (512); the shapes cards pad to 16
    copy = train_adapter(fv_core.load(weights=tmp_path / "out"), max_sequence_length=16)
    embeds = adapter.conditioning(["a red circle moving left"])
    assert torch.equal(copy.conditioning(["a red circle moving left"]), embeds)
    latents, sigma = adapter.noise(1, torch.Generator().manual_seed(0)), torch.tensor([0.5])
    expected = adapter.velocity(adapter.module("transformer"), latents, sigma, embeds)
    assert torch.equal(copy.velocity(copy.module("transformer"), latents, sigma, embeds), expected)


def test_train_refuses_a_device_the_machine_or_the_method_lacks(tmp_path):
    method = NoisyRegression(None)  # its spec trains on the default devices: cpu only
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    missing = f"cuda:{gpus}"  # past the last GPU (the only GPU asked for on a machine without one)
    with pytest.raises(ConfigError, match=rf"device='{missing}'.*Fix:"):
        train(validate({**_cfg(tmp_path / "a", 1), "device": missing}), method, progress=False)
    with pytest.raises(
        ConfigError, match=r"device='meta': method 'toy' trains on cpu only.*Fix: device: cpu"
    ):
        train(validate({**_cfg(tmp_path / "b", 1), "device": "meta"}), method, progress=False)
    with pytest.raises(ConfigError, match=r"device='gpu0' is not a torch device.*Fix: cpu, cuda"):
        train(validate({**_cfg(tmp_path / "c", 1), "device": "gpu0"}), method, progress=False)
    assert not any(tmp_path.iterdir())  # refused before anything was written
    summary = train(validate({**_cfg(tmp_path / "d", 1), "device": "cpu"}), method, progress=False)
    assert summary["spec"]["devices"] == ["cpu"]
