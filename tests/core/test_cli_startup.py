"""`fv plugins` reads the installed plugins without importing torch or Ray: each lazy registration's module
is found, not imported; `fv plugins --imports` imports them, so a broken import or a missing name shows."""

import json
import subprocess
import sys

from fv_core.registry import Registry


def test_fv_plugins_imports_neither_torch_nor_ray():
    code = (
        "import sys, contextlib, io\nfrom fv_core.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n    main(['plugins'])\n"
        "print(sorted(m for m in sys.modules if m in ('torch', 'ray', 'diffusers', 'transformers')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"


def test_fv_plugins_reports_every_installed_plugin_with_what_it_registered():
    out = subprocess.run(
        [sys.executable, "-m", "fv_core.cli", "plugins"], capture_output=True, text=True, check=True
    ).stdout
    report = {p["name"]: p for p in json.loads(out)}
    assert report["fv-cache-dit"]["registered"]["interceptors"] == ["fbcache", "dbcache", "taylorseer"]
    assert report["fv-train-dmd2"]["registered"]["options"] == ["fv-train-dmd2"]
    assert all(p["error"] is None for p in report.values()), report


def test_a_missing_module_is_found_without_importing_and_a_missing_name_by_importing():
    registry = Registry("interceptors")
    registry.register("gone", "fv_nowhere.policy:Gone", "fv-ghost")
    registry.register("typo", "fv_core.errors:NoSuchError", "fv-ghost")
    (missing,) = registry.missing_modules("fv-ghost")  # the module that is there is not imported
    assert "key 'gone' of plugin 'fv-ghost' names 'fv_nowhere.policy:Gone'" in missing
    assert "cannot be imported (ModuleNotFoundError: No module named 'fv_nowhere')" in missing
    imported = registry.import_errors("fv-ghost")
    assert len(imported) == 2 and "AttributeError" in imported[1] and "NoSuchError" in imported[1]
