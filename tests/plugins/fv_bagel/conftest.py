"""Session fixtures for fv-bagel: the tiny checkpoint, a host with fv-bagel, the loaded tiny model."""

from __future__ import annotations

import pytest

import fv_core
from fv_bagel import plugin
from fv_bagel.tiny import tiny_weights
from fv_core.plugins import PluginHost


@pytest.fixture(scope="session")
def bagel_host() -> PluginHost:
    host = PluginHost(env={})
    host.add(plugin, "fv-bagel")
    return host.collect()


@pytest.fixture(scope="session")
def bagel_path(tmp_path_factory) -> str:
    return tiny_weights(tmp_path_factory.mktemp("bagel") / "bagel-tiny")


@pytest.fixture(scope="session")
def bagel(bagel_host, bagel_path):
    return fv_core.load("bagel-tiny", bagel_path, host=bagel_host)
