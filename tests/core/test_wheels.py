"""The ``pip install fv-core <plugin>`` path: wheels into a fresh venv, found by entry point."""

import json
import subprocess

from tests.core.conftest import REPO
from tests.core.fresh_venv import build_wheels, clean_env, fresh_venv

PLUGIN = "fv-sta"


def test_core_and_plugin_wheels_install_into_fresh_venv(tmp_path):
    wheels = build_wheels([REPO, REPO / "plugins" / PLUGIN], tmp_path / "wheels")
    assert sorted(p.name.split("-")[0] for p in wheels) == ["fv_core", PLUGIN.replace("-", "_")]

    env = clean_env(FV_PLUGINS=PLUGIN)
    fresh = fresh_venv(tmp_path / "fresh", wheels, env)

    out = subprocess.run(
        [str(fresh.bin("fv")), "plugins"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    (plugin,) = [p for p in json.loads(out.stdout) if p["name"] == PLUGIN]
    assert plugin["distribution"] == PLUGIN and plugin["version"] == "0.1.0" and plugin["error"] is None
    where = subprocess.run(
        [str(fresh.python), "-c", f"import {PLUGIN.replace('-', '_')} as m; print(m.__file__)"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert where.stdout.startswith(str(fresh.site))
