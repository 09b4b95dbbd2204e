"""Wan checkpoint folders (``model_index.json`` class ``WanPipeline`` or ``WanImageToVideoPipeline``):
cards from their own configs, and named cards adapted to the folder they run on.

Registered as the reader of both pipelines: ``fv_core.load("/models/Wan2.2-TI2V-5B-Diffusers")``
builds a card from the folder, like diffusers' auto pipelines: the variant (I2V, TI2V, A14B) and
its tasks come from ``model_index.json`` and the configs. A named card on a folder takes its
sampler and flow shift defaults from the folder's scheduler.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fv_core import WeightsError
from fv_core.card import ModelCard, StepCostModel
from fv_wan.card_builder import I2V_TASKS, T2V_TASKS, TI2V_TASKS, Row, Size, build
from fv_wan.checkpoint import OPTIONAL_COMPONENTS, component_dir, listed_components
from fv_wan.variant import WanVariant

# scheduler class in the folder -> the fv sampler that reproduces it
SAMPLER_OF = {"UniPCMultistepScheduler": "unipc", "FlowMatchEulerDiscreteScheduler": "euler"}


def _config(folder: Path, file: str) -> dict[str, Any]:
    """``component/name.json`` of the checkpoint (a shared component's from its parent's folder)."""
    component, name = file.split("/", 1)
    return json.loads((component_dir(folder, component) / name).read_text())


def scheduler_defaults(folder: Path) -> dict[str, Any]:
    """The sampler and flow shift the folder's scheduler config describes."""
    config = _config(folder, "scheduler/scheduler_config.json")
    if config.get("_class_name") not in SAMPLER_OF:
        raise WeightsError(
            f"{str(folder)!r} ships the scheduler {config.get('_class_name')!r}; fv's Wan samplers reproduce "
            f"{sorted(SAMPLER_OF)}. Fix: use a checkpoint with one of those schedulers."
        )
    sampler = SAMPLER_OF[config["_class_name"]]
    shift = config.get("flow_shift") if sampler == "unipc" else config.get("shift")
    return {"sampler": sampler, "flow_shift": float(shift if shift is not None else 1.0)}


def architecture_of(variant: WanVariant) -> dict[str, dict]:
    """What a folder-built card states about its folder: the VAE's scale when it is not the default 8."""
    return {"vae": {"scale_factor_spatial": variant.spatial_scale}} if variant.spatial_scale != 8 else {}


class WanFolder:
    """The reader of ``WanPipeline`` and ``WanImageToVideoPipeline`` folders (``fv_register_pipelines``)."""

    @staticmethod
    def card(folder: Path) -> ModelCard:
        """A card for whatever Wan the folder holds: its configs, diffusers' pipeline defaults."""
        dit = _config(folder, "transformer/config.json")
        blocks, width = dit["num_layers"], dit["num_attention_heads"] * dit["attention_head_dim"]
        variant = WanVariant.of(folder)
        tasks = {"none": T2V_TASKS, "concat": I2V_TASKS, "first_frame": TI2V_TASKS}[variant.conditioning]
        cost = StepCostModel(base_s=1e-4 * blocks, per_token_s=1e-9 * blocks * width)
        row = Row(
            f"wan:{folder.name}",
            f"Wan checkpoint at {folder} ({blocks} blocks, width {width}, {variant.conditioning} image "
            f"conditioning, experts {list(variant.experts)}); card built from its configs.",
            Size(architecture_of(variant), cost, None, None, kv_capacity=256),  # the byte budget binds first
            tasks=tasks,
            optional=tuple(n for n in listed_components(folder) if n in OPTIONAL_COMPONENTS),
        )
        return WanFolder.bind(build(row), folder)

    @staticmethod
    def bind(card: ModelCard, folder: Path) -> ModelCard:
        """``card`` whose sampler and flow shift defaults, where it sets none, follow the folder's scheduler."""
        follow = scheduler_defaults(folder)
        card = card.model_copy(deep=True)
        for program in card.programs.values():
            for key, value in follow.items():
                program.defaults.setdefault(key, value)
        return card
