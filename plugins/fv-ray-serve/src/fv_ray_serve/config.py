"""The fleet section of a deploy file: how many replicas each served model runs.

A deploy file for ``fv serve --ray`` is an ordinary deploy file plus a top-level ``fleet:``
mapping, split off here before the rest is validated as a ``DeploymentCard``::

    fleet:
      models:
        wan2.1-t2v-1.3b: {min_replicas: 1, max_replicas: 4, target_queue_depth: 4,
                          ray_actor_options: {num_gpus: 1}}
        wan2.1-t2v-tiny: {replicas: 2}        # a fixed count, no autoscaling

Models the fleet section does not name run one replica.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from fv_core import ConfigError, DeploymentCard, explain
from fv_core.deploy import parse_deploy


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelFleet(Strict):
    """The replicas of one served model."""

    replicas: int | None = Field(None, ge=1)  # a fixed count (no autoscaling); None: autoscale or 1
    min_replicas: int = Field(1, ge=0)  # autoscaling floor
    max_replicas: int | None = Field(None, ge=1)  # autoscaling ceiling; set it to autoscale
    target_queue_depth: float = Field(
        4, gt=0
    )  # unfinished video jobs (and awaited images) per replica the autoscaler aims at
    upscale_delay_s: float = Field(10, ge=0)  # the queue must stay deep this long before a replica is added
    downscale_delay_s: float = Field(120, ge=0)  # ... and shallow this long before one is removed
    max_ongoing_requests: int = Field(64, ge=1)  # concurrent HTTP requests a replica takes (polls, downloads)
    ray_actor_options: dict[str, Any] = Field(default_factory=dict)  # e.g. {"num_gpus": 1}
    max_replicas_per_node: int | None = Field(None, ge=1)  # 1: spread the replicas over the cluster's nodes

    @model_validator(mode="after")
    def _one_way_to_scale(self) -> ModelFleet:
        if self.replicas is not None and self.max_replicas is not None:
            raise ValueError(
                f"replicas={self.replicas} and max_replicas={self.max_replicas} are both set; a model runs "
                "either a fixed count or autoscales. Fix: drop one of them"
            )
        if self.max_replicas is not None and self.min_replicas > self.max_replicas:
            raise ValueError(
                f"min_replicas={self.min_replicas} is above max_replicas={self.max_replicas}; the floor must "
                f"not exceed the ceiling. Fix: set max_replicas >= {self.min_replicas}"
            )
        return self

    @property
    def autoscaled(self) -> bool:
        return self.max_replicas is not None


class Fleet(Strict):
    """Replicas per served model (by served name)."""

    models: dict[str, ModelFleet] = Field(default_factory=dict)

    def of(self, served_name: str) -> ModelFleet:
        return self.models.get(served_name) or ModelFleet()


def split_fleet(data: dict[str, Any], source: str = "<deploy>") -> tuple[DeploymentCard, Fleet]:
    """The deploy card and the fleet section of deploy data; errors name the value, the rule, the fix."""
    rest = dict(data)
    raw = rest.pop("fleet", None) or {}
    deploy = parse_deploy(rest, source)
    try:
        fleet = Fleet.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(explain(exc, f"{source}: invalid fleet section", Fleet.model_fields)) from None
    served = [m.served_name for m in deploy.models]
    unknown = sorted(set(fleet.models) - set(served))
    if unknown:
        raise ConfigError(
            f"{source}: fleet.models names {unknown}, which the deploy file does not serve. Available: "
            f"{served}. Fix: use the served names (a model's name, else its card id)."
        )
    return deploy, fleet


def load_fleet_file(path: str | Path) -> tuple[DeploymentCard, Fleet]:
    """Read a YAML or JSON deploy file with an optional ``fleet:`` section."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"deploy file {str(path)!r} does not exist. Fix: pass the path of a YAML or JSON file."
        )
    try:
        text = path.read_text()
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: not a valid deploy file: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping with 'models' (and 'fleet', ...)")
    return split_fleet(data, str(path))
