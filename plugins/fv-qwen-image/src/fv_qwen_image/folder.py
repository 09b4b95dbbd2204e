"""Qwen-Image checkpoint folders (``model_index.json`` class ``QwenImagePipeline``): a card from the
folder's own configs, so ``fv_core.load("/models/Qwen-Image")`` runs any layer count, width or text
encoder size; a named card on a folder is taken as it is (``fv_core.weights.bind_card`` has checked
the configs it declares)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fv_core import WeightsError
from fv_core.card import ModelCard, StepCostModel
from fv_core.weights import component_folder, model_index
from fv_qwen_image.cards import TASKS, Row, architecture, build


def _config(folder: Path, file: str) -> dict[str, Any]:
    component, name = file.split("/", 1)
    path = component_folder(folder, component) / name
    if not path.is_file():
        raise WeightsError(
            f"{str(path)!r} is missing. Fix: point at a complete Qwen-Image folder in the published diffusers "
            "layout (transformer/, text_encoder/, tokenizer/, vae/, scheduler/, model_index.json)."
        )
    return json.loads(path.read_text())


VARIANT_FLAGS = (
    "zero_cond_t",
    "use_additional_t_cond",
    "use_layer3d_rope",
)  # transformers of other pipelines


class QwenImageFolder:
    """The reader of ``QwenImagePipeline``, ``QwenImageEditPipeline`` and ``QwenImageEditPlusPipeline``
    folders (``fv_register_pipelines``)."""

    @staticmethod
    def card(folder: Path) -> ModelCard:
        """A card for the Qwen-Image the folder holds: its configs, diffusers' pipeline defaults."""
        dit = _config(folder, "transformer/config.json")
        pipeline = model_index(folder).get("_class_name", "QwenImagePipeline")
        edit_2511 = (
            ("zero_cond_t",) if pipeline == "QwenImageEditPlusPipeline" else ()
        )  # Qwen-Image-Edit-2511
        other = [k for k in ("guidance_embeds", *VARIANT_FLAGS) if dit.get(k) and k not in edit_2511]
        if other:
            raise WeightsError(
                f"{str(folder)!r}: its transformer sets {other} (a guidance-distilled or layered variant, or "
                "edit-2511's zero_cond_t outside a QwenImageEditPlusPipeline folder); fv-qwen-image runs the "
                "Qwen-Image transformer, where they are false (zero_cond_t: Edit Plus folders only). Fix: load a "
                "Qwen/Qwen-Image, Qwen-Image-Edit or Qwen-Image-Edit-2509/2511 folder."
            )
        _config(folder, "scheduler/scheduler_config.json")
        blocks, heads, head_dim = dit["num_layers"], dit["num_attention_heads"], dit["attention_head_dim"]
        config = architecture(blocks, heads, head_dim, dit["joint_attention_dim"])
        vae = _config(folder, "vae/config.json")
        if "temperal_downsample" in vae:  # the VAE's scale sets the size rule (Params.check)
            config["vae"]["temperal_downsample"] = vae["temperal_downsample"]
        width = heads * head_dim
        if pipeline not in TASKS:
            raise WeightsError(
                f"{str(folder)!r}: model_index.json names {pipeline!r}; fv-qwen-image reads {sorted(TASKS)}. "
                "Fix: load a folder of one of those pipelines."
            )
        if TASKS[pipeline].images:
            _config(folder, "processor/preprocessor_config.json")
        row = Row(
            f"qwen-image:{folder.name}",
            f"Qwen-Image checkpoint at {folder} ({pipeline}: {blocks} blocks, width {width}); card built from its "
            "configs.",
            config,
            StepCostModel(base_s=1e-4 * blocks, per_token_s=1e-9 * blocks * width),
            None,
            pipeline=pipeline,
        )
        return build(row)

    @staticmethod
    def bind(card: ModelCard, folder: Path) -> ModelCard:
        return card
