"""Fixtures for fv-train-self-forcing: a few self-forcing steps on the tiny random-weight Wan."""

from __future__ import annotations

from pathlib import Path

import pytest
from sf_support import PROMPTS, sf_config

from fv_core.plugins import PluginHost
from fv_core.training import Role, train, validate
from fv_train_self_forcing.method import SelfForcingMethod
from fv_wan import plugin as wan_plugin


@pytest.fixture(scope="session")
def prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_text("# a comment line\n" + "\n".join(PROMPTS) + "\n")
    return path


@pytest.fixture(scope="session")
def trained(tmp_path_factory, prompts) -> tuple[SelfForcingMethod, dict, Path]:
    """The method after 4 steps (2 generator updates), the parameters it started from, the run folder."""
    out = tmp_path_factory.mktemp("self_forcing")
    method = SelfForcingMethod(validate(sf_config(out, prompts, steps=4)))
    before = {
        role: [p.detach().clone() for p in method.roles[role]["transformer"].parameters()]
        for role in (Role.STUDENT, Role.EMA, Role.CRITIC, Role.TEACHER)
    }
    train(method.cfg, method, progress=False)
    return method, before, out


@pytest.fixture(scope="session")
def wan_only_host() -> PluginHost:
    """A plugin host of fv-wan alone (the shapes cards' plugin)."""
    host = PluginHost({})
    host.add(wan_plugin, "fv-wan")
    host.collect()
    return host
