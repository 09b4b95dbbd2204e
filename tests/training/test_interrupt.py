"""Stopping ``fv train`` keeps the run: Ctrl-C saves a checkpoint at the next step boundary and prints
the resume command (no traceback); ``--resume`` finishes the run with the bits of an uninterrupted
one; a second Ctrl-C mid-save leaves the earlier checkpoints intact; resuming what is not there, or
what another method or config wrote, is a clear error."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from fv_core import ConfigError
from fv_core.cli import main
from fv_core.training import StopRequest, train, validate
from fv_core.training.trainer import check_resumable, checkpoints
from tests.plugins.fv_train_flow.train_flow_support import TINY_VAE
from tests.training.test_training_plane import NoisyRegression, _cfg

FV = str(Path(sys.executable).parent / "fv")


def _vae_config(path: Path, out: Path) -> dict:
    """The tiniest real config: fv-train-flow's ``vae`` method on a 4-channel VAE, 20 steps of 2 clips."""
    cfg = {
        "method": "vae", "output_dir": str(out), "steps": 20, "batch_size": 2, "log_every": 1,
        "eval_every": 1000, "checkpoint_every": 1000,
        "options": {"vae": TINY_VAE, "eval_clips": 2, "stats_clips": 4},
    }  # fmt: skip
    path.write_text(yaml.safe_dump(cfg))
    return cfg


def _losses(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_ctrl_c_saves_a_checkpoint_and_resume_finishes_bit_for_bit(tmp_path):
    from fv_train_flow.vae import VaeMethod

    config, run = tmp_path / "vae.yaml", tmp_path / "run"
    cfg = _vae_config(config, run)
    proc = subprocess.Popen(
        [FV, "train", str(config), "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 120
    while not (run / "log.jsonl").is_file() or not (run / "log.jsonl").read_text():  # a step is done
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, err
    assert "Traceback" not in err
    stopped = re.fullmatch(
        r"stopped by SIGINT after step (\d+); saved (\S+)\. Resume: (.+)", err.splitlines()[-1]
    )
    assert stopped, err
    step = int(stopped[1])
    assert 0 < step < 20 and Path(stopped[2]) == run / f"checkpoint-{step}"
    assert checkpoints(run) == [run / f"checkpoint-{step}"] and not (run / "final").exists()
    assert shlex.split(stopped[3]) == ["fv", "train", str(config), "--no-progress", "--resume", str(run)]

    resumed = subprocess.run([FV, *shlex.split(stopped[3])[1:]], capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming from {run / f'checkpoint-{step}'} (step {step} of 20)" in resumed.stderr

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as `fv train` runs it (threads: 1)
    try:
        whole = validate({**cfg, "output_dir": str(tmp_path / "whole")})
        train(whole, VaeMethod(whole), progress=False)
    finally:
        torch.set_num_threads(threads)
    assert _losses(run) == _losses(tmp_path / "whole")
    weights = "final/vae/diffusion_pytorch_model.safetensors"
    a, b = load_file(str(run / weights)), load_file(str(tmp_path / "whole" / weights))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resume_with_nothing_to_resume_is_a_clear_error(tmp_path, capsys):
    config = tmp_path / "vae.yaml"
    _vae_config(config, tmp_path / "run")
    assert main(["train", str(config), "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"--resume: {str(tmp_path / 'run')!r} holds no checkpoint-<step>/ folder" in err and "Fix:" in err
    assert not (tmp_path / "run").exists()


class SecondCtrlCWhileSaving(NoisyRegression):
    """Ctrl-C during step 5, and again while the checkpoint it asked for is half written."""

    def step(self, step: int) -> dict[str, float]:
        if step == 4:
            os.kill(os.getpid(), signal.SIGINT)
        return super().step(step)

    def save(self, folder: Path) -> None:
        super().save(folder)
        if folder.name.endswith("-5"):
            os.kill(os.getpid(), signal.SIGINT)


def test_a_second_ctrl_c_mid_save_keeps_the_earlier_checkpoint(tmp_path):
    torch.manual_seed(0)
    full = NoisyRegression(None)
    train(validate(_cfg(tmp_path / "full", 6)), full, progress=False)

    torch.manual_seed(0)
    method = SecondCtrlCWhileSaving(None)
    with StopRequest() as stop, pytest.raises(KeyboardInterrupt):
        train(validate(_cfg(tmp_path / "part", 6)), method, progress=False, stop=stop)
    assert checkpoints(tmp_path / "part") == [tmp_path / "part" / "checkpoint-3"]  # checkpoint_every 3
    assert not list((tmp_path / "part").glob(".checkpoint-*"))  # the half-written one is gone

    resumed = NoisyRegression(None)
    assert train(validate(_cfg(tmp_path / "part", 6)), resumed, progress=False)["resumed_from"] == 3
    assert torch.equal(resumed.w, full.w)


def test_a_checkpoint_of_another_method_or_config_is_refused(tmp_path):
    train(validate(_cfg(tmp_path, 3)), NoisyRegression(None), progress=False)
    ckpt = tmp_path / "checkpoint-3"
    assert check_resumable(validate({**_cfg(tmp_path, 6), "log_every": 2}), ckpt)["step"] == 3
    with pytest.raises(ConfigError, match=r"written by method 'toy'; this config trains 'flow'.*Fix:"):
        check_resumable(validate({**_cfg(tmp_path, 6), "method": "flow"}), ckpt)
    other = validate({**_cfg(tmp_path, 6), "optim": {"lr": 0.5}})
    with pytest.raises(ConfigError, match=r"another config: optim.lr=0.5 \(checkpoint: 0.001\).*Fix:"):
        check_resumable(other, ckpt)
