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
class Task:
    """What a pipeline class serves: its task, loop, Params and the image parts it takes."""

    name: str
    loop: str  # "module:attr" of the loop factory
    params: str  # "module:attr" of the Params model
    description: str
    images: bool = False  # takes image parts (and the processor/ component)
    one_image: bool = False  # exactly one (QwenImageEditPipeline); else one or more
    defaults: dict[str, Any] = field(default_factory=dict)


# diffusers' QwenImageEditPipeline / QwenImageEditPlusPipeline.__call__ defaults (the output size: the
# image's, None here)
EDIT_DEFAULTS: dict[str, Any] = dict(
    negative_prompt=None, true_cfg_scale=4.0, height=None, width=None, num_inference_steps=50
)
EDIT_PARAMS = "fv_qwen_image.edit_params:QwenImageEditParams"
TASKS = {
    PIPELINE: Task(
        "t2i", "fv_qwen_image.t2i_loop:QwenImageLoop", "fv_qwen_image.params:QwenImageParams", "text to image",
        defaults=BASE_DEFAULTS,
    ),
    "QwenImageEditPipeline": Task(
        "edit", "fv_qwen_image.edit_loop:QwenImageEditLoop", EDIT_PARAMS, "edit one image by an instruction",
        images=True, one_image=True, defaults=EDIT_DEFAULTS,
    ),
    "QwenImageEditPlusPipeline": Task(
        "edit", "fv_qwen_image.edit_loop:QwenImageEditPlusLoop", EDIT_PARAMS,
        "edit by an instruction over one or more images (Picture 1, 2, ...)", images=True, defaults=EDIT_DEFAULTS,
    ),
}  # fmt: skip
PROCESSOR = ("processor", "fv_qwen_image.vl_encoder:VLProcessor")  # processor/: image processor + tokenizer


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
    pipeline: str = PIPELINE  # the diffusers pipeline class of its folders (and its C1 reference)


def build(row: Row) -> ModelCard:
    """The card of ``row``: one loop (``t2i``, or ``edit`` for the edit pipelines), diffusers' pipeline
    of its folders as its C1 reference."""
    task = TASKS[row.pipeline]
    parts = {**COMPONENTS, "processor": PROCESSOR} if task.images else COMPONENTS
    components = {
        name: ComponentSpec(
            kind=kind,
            load_id=load_id,
            subfolder=name,
            required_for={task.name},
            resident_for={task.name},
            config=row.config.get(name, {}),
        )
        for name, (kind, load_id) in parts.items()
    }
    loop = LoopSpec(
        kind=LoopKind.DIFFUSION_DENOISE,
        work_unit_kind=WorkUnitKind.DIFFUSION_STEP,
        loop_factory=task.loop,
        components=list(parts),
        cache_policy=["text_embeddings"],
        step_cost=row.cost,
        steps=StepsContract(min_steps=1, max_steps=200),
        samplers=["euler"],
        params=task.params,
        accepts=["image"] if task.images else [],
        requires=["image"] if task.one_image else [],
    )
    # LoRA files as diffusers reads them for Qwen-Image (and its edit pipelines), per request, on the transformer
    lora = "diffusers.loaders.lora_pipeline:QwenImageLoraLoaderMixin"
    return ModelCard(
        model_id=row.id,
        family="qwen-image",
        description=row.description,
        programs={
            task.name: ProgramSpec(
                stages=[task.name],
                defaults={**task.defaults, **row.defaults},
                outputs=["image"],
                description=task.description,
            )
        },
        components=components,
        loops={task.name: loop},
        recipe=RecipeSpec(
            method="base", description="Qwen-Image flow-matching pretraining", assumes_loop=task.name
        ),
        pipeline=row.pipeline,
        adapters=AdapterContract(loader=lora, components=["transformer"]),
        parity=ParitySpec(level="C1", reference=f"diffusers:{row.pipeline}", tolerances={"frames": 1e-5}),
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


EDIT_NOTE = (
    "The input image goes through the Qwen2.5-VL encoder (with its vision tower) inside the prompt template and "
    "through the VAE as reference latents after the noise in the image stream; the output size defaults from it."
)
EDITS = {  # card id -> (pipeline class, name, the Hugging Face repo of its weights)
    "qwen-image-edit": ("QwenImageEditPipeline", "Qwen-Image-Edit", "Qwen/Qwen-Image-Edit"),
    "qwen-image-edit-plus": ("QwenImageEditPlusPipeline", "Qwen-Image-Edit Plus (2509)", "Qwen/Qwen-Image-Edit-2509"),
}  # fmt: skip


def edit_rows(model_id: str) -> dict[str, Row]:
    """The rows of edit card ``model_id`` and of its tiny twin (``<id>-tiny``)."""
    pipeline, name, repo = EDITS[model_id]
    tiny = Row(
        f"{model_id}-tiny",
        f"{name} ({pipeline}: a tiny Qwen2.5-VL with a tiny vision tower, processor/) {TINY_NOTE} {EDIT_NOTE}",
        architecture(2, 2, 16, 32),
        StepCostModel(base_s=0.004, per_token_s=2e-6),
        (1280, 1280),
        dict(num_inference_steps=4),
        weights=f"fv_qwen_image.tiny:tiny_{model_id.removeprefix('qwen-image-').replace('-', '_')}_weights",
        pipeline=pipeline,
    )
    full = Row(
        model_id,
        f"{name} 20B image editing ({repo} layout: 60-block MMDiT, Qwen2.5-VL-7B with its vision tower, "
        f"processor/; fetched by its Hugging Face id). {EDIT_NOTE}",
        architecture(60, 24, 128, 3584),
        StepCostModel(base_s=0.05, per_token_s=5e-5, peak_bytes_per_token=200_000),
        (1664, 1664),
        repo=repo,
        pipeline=pipeline,
    )
    return {tiny.id: tiny, full.id: full}


for _edit in EDITS:
    TABLE.update(edit_rows(_edit))


def qwen_image_tiny() -> ModelCard:
    return build(TABLE["qwen-image-tiny"])


def qwen_image() -> ModelCard:
    return build(TABLE["qwen-image"])


def qwen_image_edit_tiny() -> ModelCard:
    return build(TABLE["qwen-image-edit-tiny"])


def qwen_image_edit() -> ModelCard:
    return build(TABLE["qwen-image-edit"])


def qwen_image_edit_plus_tiny() -> ModelCard:
    return build(TABLE["qwen-image-edit-plus-tiny"])


def qwen_image_edit_plus() -> ModelCard:
    return build(TABLE["qwen-image-edit-plus"])
