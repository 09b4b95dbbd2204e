"""fv: a model-native runtime for video, image, audio and omni diffusion models.

This is the user API: load a model, generate, read artifacts, handle errors::

    import fv_core
    video = fv_core.load("wan2.1-t2v-shapes").generate(prompt="a red circle moving left")
    video.save("out.mp4")

Plugin authors build on the documented subpackages instead, each with its own ``__all__``:
``fv_core.card``, ``fv_core.loop``, ``fv_core.extend``, ``fv_core.weights``, ``fv_core.training``,
``fv_core.testing``, ``fv_core.request``, ``fv_core.cache``, ``fv_core.kv``, ``fv_core.parallel``,
``fv_core.deploy``, ``fv_core.serving``, ``fv_core.parity``, ``fv_core.program``, ``fv_core.plugins``
and ``fv_core.runtime`` (CONTRIBUTING.md; ``tests/core/test_boundary.py`` enforces it). Everything
else is internal.
"""

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fv_core.artifacts import AudioArtifact, ImageArtifact, TextArtifact, VideoArtifact
    from fv_core.deploy import DeploymentCard, load_deploy
    from fv_core.errors import (
        AdmissionInfeasible,
        Cancelled,
        CardValidationError,
        ConfigError,
        DuplicateKeyError,
        FvError,
        LimitExceeded,
        NonFiniteOutput,
        PluginLoadError,
        QueueFull,
        RecipeLoopMismatch,
        UnknownKeyError,
        WeightsError,
        explain,
    )
    from fv_core.load import load
    from fv_core.model import LoadedModel
    from fv_core.request import AudioPart, ImagePart, Part, TextPart, VideoPart

# Each name is imported on first use, so the ``fv`` command starts without torch.
_HOMES = {
    **dict.fromkeys(["AudioArtifact", "ImageArtifact", "TextArtifact", "VideoArtifact"], "fv_core.artifacts"),
    **dict.fromkeys(["DeploymentCard", "load_deploy"], "fv_core.deploy"),
    **dict.fromkeys(["AudioPart", "ImagePart", "Part", "TextPart", "VideoPart"], "fv_core.request"),
    "load": "fv_core.load",
    "LoadedModel": "fv_core.model",
}


def __getattr__(name: str) -> Any:
    """A name of ``__all__`` (the errors' home is ``fv_core.errors``), else a submodule."""
    if name in __all__:
        value = getattr(importlib.import_module(_HOMES.get(name, "fv_core.errors")), name)
        globals()[name] = value
        return value
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module 'fv_core' has no attribute {name!r}") from None


class _Package(types.ModuleType):
    """Importing the submodule ``fv_core.load`` does not hide the function ``fv_core.load``."""

    def __setattr__(self, name: str, value: Any) -> None:
        if not (name == "load" and isinstance(value, types.ModuleType)):
            super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

__version__ = "0.1.0"

__all__ = [
    "AdmissionInfeasible",
    "AudioArtifact",
    "AudioPart",
    "Cancelled",
    "CardValidationError",
    "ConfigError",
    "DeploymentCard",
    "DuplicateKeyError",
    "FvError",
    "ImageArtifact",
    "ImagePart",
    "LimitExceeded",
    "LoadedModel",
    "NonFiniteOutput",
    "Part",
    "PluginLoadError",
    "QueueFull",
    "RecipeLoopMismatch",
    "TextArtifact",
    "TextPart",
    "UnknownKeyError",
    "VideoArtifact",
    "VideoPart",
    "WeightsError",
    "explain",
    "load",
    "load_deploy",
]
