"""Fixtures for fv-train-dmd2: a few DMD2 steps on the tiny random-weight Wan."""

from __future__ import annotations

from pathlib import Path

import pytest
from dmd2_support import PROMPTS, dmd2_config

from fv_core.training import Role, train, validate
from fv_train_dmd2.method import DMD2Method


@pytest.fixture(scope="session")
def prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_text("# a comment line\n" + "\n".join(PROMPTS) + "\n")
    return path


@pytest.fixture(scope="session")
def trained(tmp_path_factory, prompts) -> tuple[DMD2Method, dict, Path]:
    """The method after 4 steps (2 generator updates), the parameters it started from, the run folder."""
    out = tmp_path_factory.mktemp("dmd2")
    method = DMD2Method(validate(dmd2_config(out, prompts, steps=4)))
    before = {
        role: [p.detach().clone() for p in method.roles[role]["transformer"].parameters()]
        for role in (Role.STUDENT, Role.CRITIC, Role.TEACHER)
    }
    train(method.cfg, method, progress=False)
    return method, before, out
