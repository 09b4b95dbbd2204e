"""Every example deploy file under examples/deploy passes `fv validate` (the real CLI) against the
installed plugins, and the fleet example's `fleet:` section is one fv-ray-serve accepts."""

from __future__ import annotations

from pathlib import Path

import pytest

from fv_core.cli import main

EXAMPLES = sorted((Path(__file__).parents[2] / "examples" / "deploy").glob("*.yaml"))
COVERED = {"wan-shapes", "ltx2-tiny", "bagel-tiny", "fbcache", "dbcache", "taylorseer", "sta", "inferix"}


def test_there_is_an_example_per_family_interceptor_kernel_parallel_plan_and_fleet():
    assert {p.stem for p in EXAMPLES} >= COVERED | {"parallel", "fleet"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_deploy_file_validates(path, capsys):
    assert main(["validate", str(path)]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.startswith(f"ok: {path}")


def test_fleet_example_is_a_fleet_fv_ray_serve_accepts():
    from fv_ray_serve.config import load_fleet_file

    deploy, fleet = load_fleet_file(next(p for p in EXAMPLES if p.stem == "fleet"))
    assert [m.served_name for m in deploy.models] == list(fleet.models)
    assert sorted(m.autoscaled for m in fleet.models.values()) == [False, True]
