"""Qwen-Image's cards as data over one builder: ``build(row)`` makes a ``ModelCard`` from a ``Row``.

``qwen-image`` (the published 20B layout, fetched by its Hugging Face id) and ``qwen-image-tiny``
(the same architecture at tiny size, random weights written once by ``fv_qwen_image.tiny``); a folder
loaded by path is a row of its own configs (``fv_qwen_image.folder``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fv_core.card import (
    AdapterContract,
    CacheContract,
    CapabilityMatrix,
    ComponentSpec,
    LoopSpec,
    ModelCard,
    ParitySpec,
    PrecisionContract,
    ProgramSpec,
    RecipeSpec,
    StepCostModel,
    StepsContract,
)
from fv_core.loop import LoopKind, WorkUnitKind

PIPELINE = "QwenImagePipeline"
# diffusers' QwenImagePipeline.__call__ defaults (1024 = default_sample_size 128 x VAE scale 8)
BASE_DEFAULTS: dict[str, Any] = dict(
    negative_prompt=None,
    true_cfg_scale=4.0,
    height=1024,
    width=1024,
    num_inference_steps=50,
    max_sequence_length=512,
)
COMPONENTS = {  # name -> (kind, loader)
    "tokenizer": ("tokenizer", "transformers:Qwen2Tokenizer"),
    "text_encoder": ("text_encoder", "transformers:Qwen2_5_VLForConditionalGeneration"),
    "transformer": ("dit", "diffusers:QwenImageTransformer2DModel"),
    "vae": ("vae", "diffusers:AutoencoderKLQwenImage"),
    "scheduler": ("scheduler", "diffusers:FlowMatchEulerDiscreteScheduler"),
}


def architecture(layers: int, heads: int, head_dim: int, text_dim: int) -> dict[str, dict]:
    """Config values a named card requires of its folder (checked at load, before any weight)."""
    return {
        "transformer": dict(
            _class_name="QwenImageTransformer2DModel",
            num_layers=layers,
            num_attention_heads=heads,
            attention_head_dim=head_dim,
            joint_attention_dim=text_dim,
            guidance_embeds=False,  # fv's forward has no guidance embedding (no distilled-guidance variant)
        ),
        "vae": dict(_class_name="AutoencoderKLQwenImage"),
        "scheduler": dict(_class_name="FlowMatchEulerDiscreteScheduler", use_dynamic_shifting=True),
    }


@dataclass(frozen=True)
class Row:
    """One card: id, description, the folder's required configs, the step cost, the largest image,
    request defaults over ``BASE_DEFAULTS``, ``weights`` (``module:attr`` of its default folder) and
    ``repo`` (the Hugging Face repo publishing its weights)."""

    id: str
    description: str
    config: dict[str, dict]
    cost: StepCostModel
    max_resolution: tuple[int, int] | None
    defaults: dict[str, Any] = field(default_factory=dict)
    weights: str | None = None
    repo: str | None = None


def build(row: Row) -> ModelCard:
    """The card of ``row``: one loop (``t2i``), diffusers' QwenImagePipeline as its C1 reference."""
    components = {
        name: ComponentSpec(
            kind=kind,
            load_id=load_id,
            subfolder=name,
            required_for={"t2i"},
            resident_for={"t2i"},
            config=row.config.get(name, {}),
        )
        for name, (kind, load_id) in COMPONENTS.items()
    }
    loop = LoopSpec(
        kind=LoopKind.DIFFUSION_DENOISE,
        work_unit_kind=WorkUnitKind.DIFFUSION_STEP,
        loop_factory="fv_qwen_image.t2i_loop:QwenImageLoop",
        components=list(COMPONENTS),
        cache_policy=["text_embeddings"],
        step_cost=row.cost,
        steps=StepsContract(min_steps=1, max_steps=200),
        samplers=["euler"],
        params="fv_qwen_image.params:QwenImageParams",
    )
    return ModelCard(
        model_id=row.id,
        family="qwen-image",
        description=row.description,
        programs={
            "t2i": ProgramSpec(
                stages=["t2i"],
                defaults={**BASE_DEFAULTS, **row.defaults},
                outputs=["image"],
                description="text to image",
            )
        },
        components=components,
        loops={"t2i": loop},
        recipe=RecipeSpec(
            method="base", description="Qwen-Image flow-matching pretraining", assumes_loop="t2i"
        ),
        pipeline=PIPELINE,
        # LoRA files as diffusers reads them for Qwen-Image, per request, on the transformer
        adapters=AdapterContract(
            loader="diffusers.loaders.lora_pipeline:QwenImageLoraLoaderMixin", components=["transformer"]
        ),
        parity=ParitySpec(level="C1", reference=f"diffusers:{PIPELINE}", tolerances={"frames": 1e-5}),
        # a deploy's packed_attention kernel packs requests of different sizes into one step
        accepts_kernels={"attention": ["sdpa"], "packed_attention": ["*"]},
        capabilities=CapabilityMatrix(
            interceptors={"step_skip", "block_skip"}, max_resolution=row.max_resolution
        ),
        caches={
            "text_embeddings": CacheContract(
                kind="feature",
                component="text_encoder",
                key_fields=["model", "component", "weights_version", "content_hash", "precision", "adapters"],
            )
        },
        precision=PrecisionContract(supported=["float32", "bfloat16"], default="float32"),
        default_weights=row.weights,
        weights_repo=row.repo,
        instance_factory="fv_qwen_image.model:QwenImageModel",
    )


TINY_NOTE = (
    "at tiny size with RANDOM weights (fixed seed), written once in the published layout into the fv cache "
    "on first use: outputs are noise, for tests, demos and benchmarks."
)
TABLE = {
    "qwen-image-tiny": Row(
        "qwen-image-tiny",
        f"Qwen-Image (QwenImageTransformer2DModel, Qwen2.5-VL text encoder, AutoencoderKLQwenImage) {TINY_NOTE}",
        architecture(2, 2, 16, 32),
        StepCostModel(base_s=0.004, per_token_s=2e-6),
        (512, 512),
        dict(height=64, width=64, num_inference_steps=4),
        weights="fv_qwen_image.tiny:tiny_weights",
    ),
    "qwen-image": Row(
        "qwen-image",
        "Qwen-Image 20B text-to-image (Qwen/Qwen-Image layout: 60-block MMDiT, Qwen2.5-VL-7B text encoder; "
        "fetched by its Hugging Face id).",
        architecture(60, 24, 128, 3584),
        StepCostModel(base_s=0.05, per_token_s=5e-5, peak_bytes_per_token=200_000),
        (1664, 1664),
        repo="Qwen/Qwen-Image",
    ),
}


def qwen_image_tiny() -> ModelCard:
    return build(TABLE["qwen-image-tiny"])


def qwen_image() -> ModelCard:
    return build(TABLE["qwen-image"])
