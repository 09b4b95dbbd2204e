"""Deploy files: which cards and plugins a deployment enables, and its limits."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from fv_core.errors import ConfigError, explain
from fv_core.workflow.spec import WorkflowSpec


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Limits(Strict):
    """Per-request and queue limits the server enforces."""

    max_frames: int = Field(81, ge=1)
    max_height: int = Field(720, ge=16)
    max_width: int = Field(1280, ge=16)
    max_steps: int = Field(100, ge=1)
    max_guidance: float = Field(20.0, ge=0)
    max_queue: int = Field(64, ge=1)  # waiting requests before "busy, retry"
    max_running: int = Field(8, ge=1)  # requests interleaved at once


class Retention(Strict):
    """How long finished jobs and their files are kept."""

    max_age_s: int | None = Field(7 * 24 * 3600, ge=0)  # a finished job expires this long after it ended
    max_bytes: int | None = Field(None, ge=0)  # videos folder cap: the oldest finished jobs go first


class AdapterDeploy(Strict):
    """One LoRA adapter a served model offers by name."""

    path: str  # a LoRA .safetensors file, or a folder (diffusers' or PEFT's layout)
    scale: float = 1.0  # the scale a request that names no scale gets
    # the model's components each of the file's components goes into, e.g. Wan2.2 A14B's both experts:
    # {"transformer": ["transformer", "transformer_2"]} (default: each into itself)
    into: dict[str, list[str]] | None = None


class ModelDeploy(Strict):
    """One served model."""

    card: str  # card id, e.g. "wan2.1-t2v-tiny"
    name: str | None = None  # served model name (default: the card id)
    # checkpoint folder or Hugging Face repo id (owner/name[@revision]); default: the card's embedded
    # weights, else its published repo
    weights: str | None = None
    kernels: dict[str, str] = Field(default_factory=dict)  # op -> variant, e.g. {"attention": "sta"}
    interceptors: list[str] = Field(default_factory=list)  # enabled interceptor names
    parallel: str | None = None  # parallel plan, e.g. "sp=2,cfg=2" (None: one process)
    precision: str | None = (
        None  # dtype the model runs in, one of its card's supported (None: the card's default)
    )
    adapters: dict[str, AdapterDeploy | str] = Field(default_factory=dict)  # name -> LoRA (or its path)
    max_adapters: int = Field(4, ge=0)  # adapters one request may combine
    adapter_budget_bytes: int = Field(1 << 30, ge=0)  # loaded adapters' bytes (least recently used go first)

    @field_validator("parallel")
    @classmethod
    def _plan(cls, value: str | None) -> str | None:
        from fv_core.parallel.plan import ParallelPlan

        return ParallelPlan.parse(value).id if value is not None else None

    @property
    def served_name(self) -> str:
        return self.name or self.card


class Scheduling(Strict):
    """How the engine picks the work of each step (fv_core/runtime/policy.py)."""

    # auto: batch only where the measured batch curve says it pays, else the least remaining work first,
    # with an aging bound; fair: every running request one step per tick, compatible steps batched;
    # fifo: one request at a time, in arrival order
    policy: Literal["auto", "fifo", "fair"] = "auto"
    max_wait_factor: float = Field(4.0, ge=1)  # auto: a request is done within this x its predicted solo time
    ttfs_target_s: float | None = Field(None, gt=0)  # auto: first step within this many s (None: no target)
    # resident weights + predicted step peaks of the requests running at once; a request that can never fit is
    # refused at submission (None: what the device has)
    memory_budget_bytes: int | None = Field(None, ge=1)


class DeploymentCard(Strict):
    """A deployment: plugins enabled by name, models, limits, plugin options."""

    plugins: list[str] = Field(default_factory=list)  # enabled plugins; installed but unnamed = inactive
    models: list[ModelDeploy] = Field(min_length=1)
    limits: Limits | None = Field(default_factory=Limits)  # None: no per-request caps (a replay's own plan)
    retention: Retention = Field(default_factory=Retention)
    scheduling: Scheduling = Field(default_factory=Scheduling)
    # id -> stages over the served models, or the id of a workflow a plugin registers
    workflows: dict[str, WorkflowSpec | str] = Field(default_factory=dict)
    plugin_options: dict[str, dict[str, Any]] = Field(default_factory=dict)  # plugin -> options
    data_dir: str | None = None  # jobs database and artifacts; None: $FV_DATA_DIR or the user's data dir
    # the job database: sqlite:///path/jobs.sqlite3 or postgresql://user:pw@host:port/db (a fleet across
    # hosts); None: SQLite in the data dir
    store: str | None = None
    # where artifacts live: a folder every node mounts (file:///path) or s3://bucket/prefix; None: the data dir
    artifacts: str | None = None
    # "bitwise": a seeded request's output never depends on what else is running (steps of different
    # requests share a call only through their batch-invariant bodies, WorkPlan.invariant_body);
    # "batched": compatible steps share calls (equal to a solo run only within the batched tolerance)
    determinism: Literal["bitwise", "batched"] = "batched"  # bitwise's cost: bench/results/serve_load.json
    shutdown_grace_s: float = Field(30, ge=0)  # on shutdown, jobs get this long to finish before cancelling
    # replicas per model for `fv serve --ray` (validated by fv-ray-serve; one server ignores it)
    fleet: dict[str, Any] | None = None

    @field_validator("store")
    @classmethod
    def _store(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("sqlite:///", "postgresql://", "postgres://")):
            raise ValueError(
                "a job database URL is sqlite:///path/jobs.sqlite3 (one host) or "
                "postgresql://user:password@host:port/database (a fleet across hosts)"
            )
        return value

    @field_validator("artifacts")
    @classmethod
    def _artifacts(cls, value: str | None) -> str | None:
        if value is not None and not (value.startswith("file:///") or re.match(r"^s3://[^/]+", value)):
            raise ValueError("artifact storage is file:///a/path/every/node/mounts or s3://bucket/prefix")
        return value

    def model(self, name: str) -> ModelDeploy:
        for m in self.models:
            if m.served_name == name:
                return m
        available = [m.served_name for m in self.models]
        raise ConfigError(
            f"model {name!r} is not deployed. Available: {available}. Fix: use one of these names."
        )


def parse_deploy(data: dict[str, Any], source: str = "<deploy>") -> DeploymentCard:
    """Validate deploy data; errors name the field, the value and the fix."""
    try:
        return DeploymentCard.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(
            explain(exc, f"{source}: invalid deploy file", DeploymentCard.model_fields)
        ) from None


def load_deploy(path: str | Path) -> DeploymentCard:
    """Read a YAML or JSON deploy file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"deploy file {str(path)!r} does not exist. Fix: pass the path of a YAML or JSON file."
        )
    text = path.read_text()
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(
            f"{path}: not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {exc}"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: the top level must be a mapping with 'models' (and 'plugins', 'limits', ...)"
        )
    return parse_deploy(data, str(path))
