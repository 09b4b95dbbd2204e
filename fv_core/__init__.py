"""fv: a model-native runtime for video, image, audio and omni diffusion models."""

from fv_core.artifacts import VideoArtifact
from fv_core.cache import CacheKey, FeatureCache, content_hash
from fv_core.card import (
    CacheContract,
    CapabilityMatrix,
    ComponentSpec,
    LoopSpec,
    ModelCard,
    ParallelismContract,
    ParitySpec,
    PrecisionContract,
    RecipeSpec,
    StepCostModel,
    StepsContract,
    check_loop_request,
)
from fv_core.deploy import DeploymentCard, load_deploy
from fv_core.errors import (
    AdmissionInfeasible,
    Cancelled,
    CardValidationError,
    ConfigError,
    DuplicateKeyError,
    FvError,
    PluginLoadError,
    QueueFull,
    RecipeLoopMismatch,
    UnknownKeyError,
    WeightsError,
)
from fv_core.extend import Observer, StepInterceptor, plugin_slot
from fv_core.generate import generate_video
from fv_core.hookspecs import hookimpl
from fv_core.loop import LoopContext, LoopRunner
from fv_core.loop.contracts import (
    BatchKey,
    Done,
    Loop,
    LoopKind,
    LoopResult,
    LoopState,
    Profile,
    StepResult,
    StreamEvent,
    WorkPlan,
    WorkUnitKind,
)
from fv_core.model import LoadedModel, load_model
from fv_core.parity import ParityAligner, assert_interleave_parity, check_batched_parity
from fv_core.plugins import PluginHost, load_plugins
from fv_core.program import Program, Stage
from fv_core.registry import lookup_kernel, resolve_lazy
from fv_core.request import Request
from fv_core.runtime import AsyncEngine, Budget, Engine

__version__ = "0.1.0"

__all__ = [
    "AdmissionInfeasible",
    "AsyncEngine",
    "BatchKey",
    "Budget",
    "CacheContract",
    "CacheKey",
    "Cancelled",
    "CapabilityMatrix",
    "CardValidationError",
    "ComponentSpec",
    "ConfigError",
    "DeploymentCard",
    "Done",
    "DuplicateKeyError",
    "Engine",
    "FeatureCache",
    "FvError",
    "LoadedModel",
    "Loop",
    "LoopContext",
    "LoopKind",
    "LoopResult",
    "LoopRunner",
    "LoopSpec",
    "LoopState",
    "ModelCard",
    "Observer",
    "ParallelismContract",
    "ParityAligner",
    "ParitySpec",
    "PluginHost",
    "PluginLoadError",
    "PrecisionContract",
    "Profile",
    "Program",
    "QueueFull",
    "RecipeLoopMismatch",
    "RecipeSpec",
    "Request",
    "Stage",
    "StepCostModel",
    "StepInterceptor",
    "StepResult",
    "StepsContract",
    "StreamEvent",
    "UnknownKeyError",
    "VideoArtifact",
    "WeightsError",
    "WorkPlan",
    "WorkUnitKind",
    "assert_interleave_parity",
    "check_batched_parity",
    "check_loop_request",
    "content_hash",
    "generate_video",
    "hookimpl",
    "load_deploy",
    "load_model",
    "load_plugins",
    "lookup_kernel",
    "plugin_slot",
    "resolve_lazy",
]
