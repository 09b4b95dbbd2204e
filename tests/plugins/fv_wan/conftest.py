"""Session fixtures for fv-wan: one tiny checkpoint, one fv instance, one diffusers WanPipeline oracle."""

from __future__ import annotations

import pytest
from wan_support import tiny_instance

from fv_core.plugins import PluginHost
from fv_wan import plugin
from fv_wan.model import WanModel
from fv_wan.tiny import tiny_weights


@pytest.fixture(scope="session")
def wan_host() -> PluginHost:
    """Plugins as a fresh process has them: fv-wan only (auto-loading stays off in tests)."""
    host = PluginHost(env={})
    host.add(plugin, "fv-wan")
    return host.collect()


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory) -> str:
    return tiny_weights(tmp_path_factory.mktemp("wan") / "wan2.1-t2v-tiny")


@pytest.fixture(scope="session")
def tiny_model(tiny_path) -> WanModel:
    return tiny_instance(tiny_path)


@pytest.fixture(scope="session")
def pipe(tiny_path):
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(tiny_path)
    pipe.set_progress_bar_config(disable=True)
    return pipe
