"""Meta-tests: every hookspec is documented and exercised; the public API is pinned."""

import inspect
from pathlib import Path

import pytest

import fv_core
from fv_core import hookspecs

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", hookspecs.HOOK_NAMES)
def test_hookspec_documented_and_exercised(name):
    doc = inspect.getdoc(getattr(hookspecs, name)) or ""
    assert ":param register:" in doc, f"{name} needs a docstring with :param register:"
    assert name in (REPO / "CONTRIBUTING.md").read_text(), f"{name} is not documented in CONTRIBUTING.md"
    tests = "".join(p.read_text() for p in (REPO / "tests").rglob("test_*.py") if p.name != "test_meta.py")
    assert f"def {name}(" in tests, f"no test implements {name}"


def test_hook_names_cover_every_registry():
    from fv_core.registry import REGISTRY_NAMES

    assert sorted(n.removeprefix("fv_register_") for n in hookspecs.HOOK_NAMES) == sorted(REGISTRY_NAMES)


def test_public_api_is_pinned():
    assert sorted(fv_core.__all__) == fv_core.__all__, "keep __all__ sorted"
    assert fv_core.__all__ == [  # the user API: load, artifacts, parts, errors, deploy files
        "AdmissionInfeasible", "AudioArtifact", "AudioPart", "Cancelled", "CardValidationError", "ConfigError",
        "DeploymentCard", "DuplicateKeyError", "FvError", "ImageArtifact", "ImagePart", "LimitExceeded",
        "LoadedModel", "NonFiniteOutput", "Part", "PluginLoadError", "QueueFull", "RecipeLoopMismatch",
        "TextArtifact", "TextPart", "UnknownKeyError", "VideoArtifact", "VideoPart", "WeightsError", "explain",
        "load", "load_deploy",
    ]  # fmt: skip
    for name in fv_core.__all__:
        assert getattr(fv_core, name) is not None
