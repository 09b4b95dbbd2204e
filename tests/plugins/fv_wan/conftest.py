"""Session fixtures for fv-wan: one tiny checkpoint, one fv instance, one diffusers WanPipeline oracle,
and tiny folders of every Wan variant in two shapes."""

from __future__ import annotations

import pytest
from wan_support import tiny_instance

from fv_core.plugins import PluginHost
from fv_wan import plugin
from fv_wan.model import WanModel
from fv_wan.tiny import tiny_weights, write_tiny_checkpoint

VARIANTS = ("i2v", "ti2v", "t2v-a14b", "i2v-a14b")
# a second shape of each variant: 3 blocks of 3 heads x 8 (the added image K/V projection follows the width)
SECOND_SHAPE = dict(num_layers=3, num_attention_heads=3, attention_head_dim=8, ffn_dim=48)


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


@pytest.fixture(scope="session")
def variant_folders(tmp_path_factory):
    """Tiny folders of every variant in two shapes: ``(variant, shape) -> path``."""
    root = tmp_path_factory.mktemp("wan-variants")
    folders = {}
    for variant in VARIANTS:
        for shape, overrides in (("first", None), ("second", SECOND_SHAPE)):
            extra = dict(overrides or {})
            if overrides and variant == "i2v":
                extra["added_kv_proj_dim"] = 24
            path = root / f"{variant}-{shape}"
            write_tiny_checkpoint(path, transformer=extra or None, seed=11, variant=variant)
            folders[variant, shape] = str(path)
    return folders
