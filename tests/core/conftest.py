"""Fixtures for core tests: plugin hosts with auto-loading off, and installed example plugins."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fv_core.card import (
    CacheContract,
    CapabilityMatrix,
    ComponentSpec,
    LoopSpec,
    ModelCard,
    ProgramSpec,
    RecipeSpec,
)
from fv_core.loop import LoopKind, WorkUnitKind
from fv_core.plugins import PluginHost

REPO = Path(__file__).resolve().parents[2]
EXAMPLE_PLUGIN = REPO / "tests" / "fixtures" / "fv-example-plugin"


def make_card(model_id: str = "toy", **overrides) -> ModelCard:
    """A small valid card; ``overrides`` replace top-level fields."""
    fields = dict(
        model_id=model_id,
        family="toy",
        description="a toy card for core tests",
        components={
            "dit": ComponentSpec(kind="dit", load_id="torch.nn:Linear", required_for={"t2v"}),
            "vae": ComponentSpec(kind="vae", load_id="torch.nn:Identity", required_for={"t2v"}),
        },
        loops={
            "denoise": LoopSpec(
                kind=LoopKind.DIFFUSION_DENOISE,
                work_unit_kind=WorkUnitKind.DIFFUSION_STEP,
                loop_factory="toy.loops:Denoise",
                components=["dit"],
                cache_policy=["text"],
            )
        },
        programs={"t2v": ProgramSpec(stages=["denoise"])},
        recipe=RecipeSpec(assumes_loop="denoise"),
        capabilities=CapabilityMatrix(interceptors={"block_skip"}),
        caches={"text": CacheContract(kind="feature", key_fields=["model", "content_hash"])},
    )
    fields.update(overrides)
    return ModelCard(**fields)


@pytest.fixture
def host() -> PluginHost:
    """A host with only the built-in plugin; tests add plugins by hand."""
    return PluginHost(env={})


@pytest.fixture(scope="session")
def installed_plugins(tmp_path_factory) -> Path:
    """A site directory holding the example plugin installed from its wheel, and a broken plugin.

    The broken one is an installed distribution (dist-info with an entry
    point) whose module raises on import.
    """
    site = tmp_path_factory.mktemp("site")
    wheels = tmp_path_factory.mktemp("wheels")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(EXAMPLE_PLUGIN)],
        check=True,
    )
    (wheel,) = wheels.glob("fv_example-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True)
    (site / "fv_broken.py").write_text("raise RuntimeError('boom: missing CUDA toolkit')\n")
    dist = site / "fv_broken-0.0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fv-broken\nVersion: 0.0.1\n")
    (dist / "entry_points.txt").write_text("[fv.plugins]\nfv-broken = fv_broken\n")
    return site


@pytest.fixture
def on_path(installed_plugins, monkeypatch):
    """Make the installed example plugins importable in this process."""
    monkeypatch.syspath_prepend(str(installed_plugins))
    yield installed_plugins
    for name in [m for m in sys.modules if m.startswith(("fv_example", "fv_broken"))]:
        del sys.modules[name]
