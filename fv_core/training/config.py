"""``fv train`` configuration: one YAML file, validated by pydantic with ``extra="forbid"``.

The top level is method-independent (steps, batch, optimiser, logging, checkpoints); ``options``
belongs to the method named by ``method`` and is validated by that method's own schema
(``validate_options``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, TypeVar

import torch
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fv_core.devices import check_device
from fv_core.errors import ConfigError, explain
from fv_core.training.method import MethodSpec, Role

Options = TypeVar("Options", bound=BaseModel)


class StrictModel(BaseModel):
    """A config section that refuses unknown fields (a typo is an error, not a silent default)."""

    model_config = ConfigDict(extra="forbid")


class OptimConfig(StrictModel):
    """AdamW with linear warmup then constant or cosine decay, and grad-norm clipping."""

    lr: float = Field(1e-3, gt=0)
    betas: tuple[float, float] = (0.9, 0.99)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(50, ge=0)
    decay: Literal["constant", "cosine"] = "cosine"
    min_lr_ratio: float = Field(0.1, ge=0, le=1)  # cosine floor as a fraction of lr
    grad_clip: float = Field(1.0, gt=0)


class DataConfig(StrictModel):
    """Which stream a method draws its clips or prompts from; ``kind`` is a name the method knows."""

    kind: str = "shapes"
    seed: int = 0


class SyncConfig(StrictModel):
    """Push a role's weights to a running ``fv serve`` every ``every`` steps (hot weight sync): the
    server swaps them in at a step boundary as version ``<method>-step-<N>``."""

    url: str  # the server, e.g. http://127.0.0.1:8000
    every: int = Field(gt=0)
    role: Role = Role.STUDENT  # whose weights (a key of the method's roles: student, ema, ...)
    components: list[str] = Field(default_factory=lambda: ["transformer"], min_length=1)
    model: str | None = None  # the served model name (default: the server's first)
    api_key_env: str | None = "FV_API_KEY"  # environment variable holding the server's API key


class TrainConfig(StrictModel):
    method: str  # a registered training method (`fv plugins` lists them)
    output_dir: Path  # checkpoints, log.jsonl, loss.png; the final model goes to <output_dir>/final
    seed: int = 0  # initialisation, timesteps, noise and caption dropout
    steps: int = Field(gt=0)
    batch_size: int = Field(8, gt=0)
    threads: int = Field(1, gt=0)  # torch intra-op threads; 1 avoids oversubscription on shared CPUs
    device: str = "cpu"  # torch device the method trains on (cpu, cuda, cuda:1); see check_train_device
    log_every: int = Field(10, gt=0)
    eval_every: int = Field(200, gt=0)
    checkpoint_every: int = Field(200, gt=0)
    keep_checkpoints: int = Field(2, gt=0)
    optim: OptimConfig = OptimConfig()
    data: DataConfig = DataConfig()
    sync: SyncConfig | None = None  # push weights to a live server while training
    options: dict[str, Any] = {}  # validated by the method's option schema


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """Read and validate a YAML config; relative ``output_dir`` and option paths resolve from the CWD."""
    try:
        raw = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read training config {str(path)!r}: {exc}") from exc
    return validate(raw | (overrides or {}), source=str(path))


def validate(raw: dict[str, Any], source: str = "config") -> TrainConfig:
    try:
        return TrainConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(explain(exc, f"invalid {source}", TrainConfig.model_fields)) from None


def check_train_device(cfg: TrainConfig, spec: MethodSpec) -> torch.device:
    """``cfg.device`` as a torch device, or a ConfigError: a device this machine lacks, or one whose
    type the method does not train on (``spec.devices``)."""
    device = check_device(cfg.device)
    if device.type not in spec.devices:
        raise ConfigError(
            f"device={cfg.device!r}: method {cfg.method!r} trains on {' or '.join(spec.devices)} only. "
            f"Fix: device: {spec.devices[0]}"
        )
    return device


def validate_options(schema: type[Options], options: dict[str, Any], method: str) -> Options:
    """``options`` checked against the method's schema; errors name the field, the rule and the fix."""
    try:
        return schema.model_validate(options)
    except ValidationError as exc:
        raise ConfigError(
            explain(exc, f"invalid options of method {method!r}", schema.model_fields)
        ) from None


def read_prompts(path: str | Path, option: str = "options.prompts") -> list[str]:
    """The prompts of a text file: one per non-empty line, ``#`` lines are comments. ``option``
    names the config field in errors."""
    try:
        lines = [line.strip() for line in Path(path).read_text().splitlines()]
    except OSError as exc:
        raise ConfigError(
            f"{option}={str(path)!r} cannot be read ({exc}). Fix: point it at a text file with one "
            "prompt per line (e.g. configs/shapes/prompts.txt)"
        ) from None
    prompts = [line for line in lines if line and not line.startswith("#")]
    if not prompts:
        raise ConfigError(f"{option}={str(path)!r} holds no prompts. Fix: write one prompt per line into it")
    return prompts
