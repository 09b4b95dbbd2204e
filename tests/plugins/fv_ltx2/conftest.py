"""Session fixtures for fv-ltx2: the tiny checkpoint, a differently shaped one, a host with fv-ltx2."""

from __future__ import annotations

import pytest

from fv_core.plugins import PluginHost
from fv_ltx2 import plugin
from fv_ltx2.tiny import tiny_weights, write_tiny_checkpoint


@pytest.fixture(scope="session")
def ltx_host() -> PluginHost:
    host = PluginHost(env={})
    host.add(plugin, "fv-ltx2")
    return host.collect()


@pytest.fixture(scope="session")
def ltx_path(tmp_path_factory) -> str:
    return tiny_weights(tmp_path_factory.mktemp("ltx2") / "ltx2-tiny")


@pytest.fixture(scope="session")
def ltx3_path(tmp_path_factory) -> str:
    """Three blocks of 2x16 video heads: a second, differently shaped LTX-2."""
    folder = tmp_path_factory.mktemp("ltx2") / "ltx2-three-blocks"
    write_tiny_checkpoint(folder, transformer={"num_layers": 3, "attention_head_dim": 16}, seed=11)
    return str(folder)
