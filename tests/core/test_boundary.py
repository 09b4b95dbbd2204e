"""The plugin boundary, enforced: plugins import only the documented core API and the plugins they
declare; the core imports no plugin.

Two documented surfaces: the user API (``fv_core.__all__``: ``load``, artifacts, parts, errors) and the
plugin-author API (the subpackages in ``PLUGIN_API``, each with its own ``__all__``; CONTRIBUTING.md
lists the same). Everything else in ``fv_core`` is internal and may change without notice.
"""

from __future__ import annotations

import ast
import importlib
import re
import tomllib
from pathlib import Path

import fv_core

REPO = Path(__file__).resolve().parents[2]
PLUGIN_API = (
    "fv_core.adapters",
    "fv_core.cache",
    "fv_core.card",
    "fv_core.deploy",
    "fv_core.extend",
    "fv_core.kv",
    "fv_core.loop",
    "fv_core.parallel",
    "fv_core.parity",
    "fv_core.plugins",
    "fv_core.program",
    "fv_core.request",
    "fv_core.runtime",
    "fv_core.serving",
    "fv_core.testing",
    "fv_core.training",
    "fv_core.weights",
)


def _distributions() -> dict[str, tuple[str, set[str], Path]]:
    """Import package -> (distribution name, the distributions it depends on, its source folder)."""
    out = {}
    for toml in sorted(REPO.glob("plugins/*/pyproject.toml")):
        project = tomllib.loads(toml.read_text())["project"]
        deps = {re.split(r"[\[<>=!~ ;]", d, maxsplit=1)[0].strip() for d in project.get("dependencies", [])}
        for package in (toml.parent / "src").iterdir():
            if (package / "__init__.py").is_file():
                out[package.name] = (project["name"], deps, package)
    return out


def _imports(path: Path) -> list[tuple[int, str, tuple[str, ...]]]:
    """``(line, module, names)`` of every absolute import in ``path`` (function-level ones included), and
    of every ``fv_core.x.y`` reached by attribute after ``import fv_core``."""
    found: set[tuple[int, str, tuple[str, ...]]] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add((node.lineno, node.module, tuple(a.name for a in node.names)))
        elif isinstance(node, ast.Import):
            found |= {(node.lineno, a.name, ()) for a in node.names}
        elif isinstance(node, ast.Attribute) and (chain := _core_chain(node)):
            found.add((node.lineno, *chain))
    return sorted(found)


def _core_chain(node: ast.Attribute) -> tuple[str, tuple[str, ...]] | None:
    """``fv_core.a`` -> ``("fv_core", ("a",))``; ``fv_core.api.b`` -> ``("fv_core.api", ("b",))`` for a
    documented subpackage ``api``, so the names are checked as an import of them would be."""
    parts = [node.attr]
    while isinstance(node.value, ast.Attribute):
        node = node.value
        parts.insert(0, node.attr)
    if not (isinstance(node.value, ast.Name) and node.value.id == "fv_core"):
        return None
    if (
        f"fv_core.{parts[0]}" in PLUGIN_API
    ):  # the subpackage itself is public; what is taken from it is checked
        return (f"fv_core.{parts[0]}", (parts[1],)) if len(parts) > 1 else None
    return "fv_core", (parts[0],)


def _core_violation(module: str, names: list[str]) -> str | None:
    if module == "fv_core":
        unknown = [n for n in names if n not in fv_core.__all__]
        return f"fv_core has no public {unknown} (user API: fv_core.__all__)" if unknown else None
    api = next((m for m in PLUGIN_API if module == m), None)
    if api is None:
        return f"{module} is not a documented core module"
    exported = importlib.import_module(api).__all__
    unknown = [n for n in names if n not in exported]
    return f"{api}.__all__ does not export {unknown}" if unknown else None


def test_plugins_import_only_the_documented_core_api():
    problems = []
    for _, _, folder in _distributions().values():
        for path in sorted(folder.rglob("*.py")):
            for line, module, names in _imports(path):
                if module.split(".")[0] != "fv_core":
                    continue
                problem = _core_violation(module, list(names))
                if problem:
                    problems.append(f"{path.relative_to(REPO)}:{line}: {problem}")
    api = ", ".join(PLUGIN_API)
    assert not problems, f"plugins reach outside the core's documented API ({api}):\n" + "\n".join(problems)


def test_plugins_import_only_the_plugins_they_depend_on():
    dists = _distributions()
    problems = []
    for package, (dist, deps, folder) in dists.items():
        for path in sorted(folder.rglob("*.py")):
            for line, module, _ in _imports(path):
                top = module.split(".")[0]
                if top in dists and top != package and dists[top][0] not in deps:
                    other = dists[top][0]
                    problems.append(
                        f"{path.relative_to(REPO)}:{line}: imports {top} but {dist}'s pyproject.toml does not "
                        f"depend on {other}. Fix: add {other!r} to its dependencies, or drop the import."
                    )
    assert not problems, "\n".join(problems)


def test_core_imports_no_plugin():
    plugins = set(_distributions())
    problems = [
        f"{path.relative_to(REPO)}:{line}: imports {module}"
        for path in sorted((REPO / "fv_core").rglob("*.py"))
        for line, module, _ in _imports(path)
        if module.split(".")[0] in plugins
    ]
    assert not problems, "fv_core must not import a plugin (offer a hook instead):\n" + "\n".join(problems)


def test_every_api_module_exports_what_it_names():
    for module in PLUGIN_API:
        exported = importlib.import_module(module).__all__
        assert exported, module
        missing = [n for n in exported if not hasattr(importlib.import_module(module), n)]
        assert not missing, f"{module}.__all__ names {missing}, which it does not define"


def test_contributing_documents_the_same_api():
    text = (REPO / "CONTRIBUTING.md").read_text()
    documented = set(re.findall(r"`(fv_core\.[a-z_]+)`", text))
    assert set(PLUGIN_API) <= documented, f"CONTRIBUTING.md misses {sorted(set(PLUGIN_API) - documented)}"


def test_the_boundary_test_sees_a_violation(tmp_path):
    """The scan catches what it must: an internal module, a name outside __all__, a function-level import,
    and the same reached by attribute after ``import fv_core`` (while ``fv_core.load`` is public)."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from fv_core.card.assemble import complete_card\n\ndef f():\n    from fv_core import Engine\n"
        "import fv_core\nfv_core.card.assemble.complete_card(fv_core.Engine, fv_core.load)\n"
    )
    problems = [(line, p) for line, m, n in _imports(bad) if (p := _core_violation(m, list(n)))]
    assert [line for line, _ in problems] == [1, 4, 6, 6]
    assert "not a documented core module" in problems[0][1] and "Engine" in problems[1][1]
    assert "'assemble'" in problems[2][1] + problems[3][1] and "Engine" in problems[2][1] + problems[3][1]


FAMILIES = ("fv-wan", "fv-ltx2", "fv-bagel", "fv-qwen-image")
FAMILY_FILES = ("plugin.py", "cards.py", "params.py", "model.py", "tiny.py")  # CONTRIBUTING's list
MAX_LINES = 500


def test_families_have_contributings_file_list():
    problems = []
    for family in FAMILIES:
        [package] = [
            p for p in (REPO / "plugins" / family / "src").iterdir() if (p / "__init__.py").is_file()
        ]
        missing = [f for f in FAMILY_FILES if not (package / f).is_file()]
        loops = sorted(p.name for p in package.glob("*_loop.py"))
        if missing or not loops or (package / "loop.py").exists():
            problems.append(f"{family}: missing {missing}, loop files {loops} (one <task>_loop.py per loop)")
    assert not problems, "\n".join(problems)


def test_no_core_or_family_module_is_over_500_lines():
    folders = [REPO / "fv_core", *(REPO / "plugins" / f / "src" for f in FAMILIES)]
    long = [
        f"{path.relative_to(REPO)}: {n} lines"
        for folder in folders
        for path in sorted(folder.rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    ]
    assert not long, "split these by role:\n" + "\n".join(long)
