"""Test support: wheels built from this checkout, installed into a fresh venv like ``pip install`` would.

The fresh venv holds only the wheels given; third-party dependencies (torch, diffusers, ...)
come from this environment through a ``.pth`` file, after the fresh site-packages.
"""

from __future__ import annotations

import os
import site
import subprocess
import sys
import venv
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

PIP = ["-m", "pip", "--disable-pip-version-check", "-q"]


def build_wheels(projects: Iterable[Path], dest: Path) -> list[Path]:
    """``pip wheel --no-deps --no-build-isolation`` of each project folder into ``dest``."""
    for project in projects:
        subprocess.run(
            [
                sys.executable,
                *PIP,
                "wheel",
                "--no-deps",
                "--no-build-isolation",
                "-w",
                str(dest),
                str(project),
            ],
            check=True,
        )
    return sorted(dest.glob("*.whl"))


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without PYTHONPATH (nothing from the checkout leaks in), plus ``extra``."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | extra


@dataclass(frozen=True)
class FreshVenv:
    """A venv with the given wheels installed (no deps) and this environment's packages behind them."""

    root: Path  # the venv folder
    site: Path  # its site-packages, where the wheels went

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    def bin(self, name: str) -> Path:
        """An installed console script, e.g. ``fv``."""
        return self.root / "bin" / name


def fresh_venv(root: Path, wheels: Iterable[Path], env: dict[str, str] | None = None) -> FreshVenv:
    """Create a venv at ``root``, ``pip install --no-deps`` the ``wheels`` into it, and make this
    environment's site-packages importable after its own."""
    venv.create(root, with_pip=True)
    python = root / "bin" / "python"
    subprocess.run(
        [str(python), *PIP, "install", "--no-deps", *map(str, wheels)], env=env or clean_env(), check=True
    )
    fresh_site = next(root.glob("lib/python*/site-packages"))
    (fresh_site / "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return FreshVenv(root, fresh_site)
