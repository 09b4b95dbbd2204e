"""Fixtures for fv-train-flow: a tiny VAE and a tiny flow model, both trained by ``fv train``'s loop."""

from __future__ import annotations

from pathlib import Path

import pytest
from train_flow_support import TINY_VAE, flow_config

from fv_core.training import train, validate
from fv_train_flow.method import FlowMethod
from fv_train_flow.vae import VaeMethod


@pytest.fixture(scope="session")
def vae_dir(tmp_path_factory) -> Path:
    """A VAE trained for two steps by the ``vae`` method (random-ish, but the real layout)."""
    out = tmp_path_factory.mktemp("vae")
    cfg = validate({
        "method": "vae", "output_dir": str(out), "steps": 2, "batch_size": 2, "log_every": 1,
        "options": {"vae": TINY_VAE, "eval_clips": 2, "stats_clips": 4},
    })  # fmt: skip
    train(cfg, VaeMethod(cfg), progress=False)
    return out / "final" / "vae"


@pytest.fixture(scope="session")
def trained(tmp_path_factory, vae_dir) -> tuple[FlowMethod, dict, Path]:
    """A tiny flow model after 24 steps: the method, its validation loss before training, the run folder."""
    out = tmp_path_factory.mktemp("flow")
    cfg = validate(flow_config(out, vae_dir, steps=24, checkpoint_every=12))
    method = FlowMethod(cfg)
    before = method.evaluate(0)
    train(cfg, method, progress=False)
    return method, before, out
