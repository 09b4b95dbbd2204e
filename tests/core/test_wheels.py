"""The ``pip install fv-core <plugin>`` path: wheels into a fresh venv, found by entry point."""

import json
import os
import site
import subprocess
import sys
import venv

from tests.core.conftest import REPO

PLUGIN = "fv-sta"


def test_core_and_plugin_wheels_install_into_fresh_venv(tmp_path):
    wheels = tmp_path / "wheels"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    for project in (REPO, REPO / "plugins" / PLUGIN):
        subprocess.run(
            [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(project)], check=True
        )
    built = sorted(p.name.split("-")[0] for p in wheels.glob("*.whl"))
    assert built == ["fv_core", PLUGIN.replace("-", "_")]

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"FV_PLUGINS": PLUGIN}
    fresh = tmp_path / "fresh"
    venv.create(fresh, with_pip=True)
    fresh_pip = [str(fresh / "bin" / "python"), "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*fresh_pip, "install", "--no-deps", *map(str, wheels.glob("*.whl"))], env=env, check=True)
    fresh_site = next(fresh.glob("lib/python*/site-packages"))
    # Third-party dependencies (torch, pydantic, ...) come from this environment, after the fresh site.
    (fresh_site / "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")

    out = subprocess.run(
        [str(fresh / "bin" / "fv"), "plugins"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    (plugin,) = [p for p in json.loads(out.stdout) if p["name"] == PLUGIN]
    assert plugin["distribution"] == PLUGIN and plugin["version"] == "0.1.0" and plugin["error"] is None
    where = subprocess.run(
        [str(fresh / "bin" / "python"), "-c", f"import {PLUGIN.replace('-', '_')} as m; print(m.__file__)"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert where.stdout.startswith(str(fresh_site))
