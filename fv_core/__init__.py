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
