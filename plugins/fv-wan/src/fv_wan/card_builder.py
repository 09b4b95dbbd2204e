"""The one builder of Wan's cards: ``build(row)`` makes a ``ModelCard`` from a ``Row`` of data.

A ``Row`` names a card's id, description and ``Size`` (the architecture its folder must have, the step
cost, the largest request), its tasks and optional components, request defaults and weights, and what
sets its loop apart: fixed timesteps (a distilled student on the ``dmd`` sampler), a KV pool (causal
Wan, chunk by chunk) or neither (flow matching with the checkpoint's sampler at any step count). The
named cards are rows of ``fv_wan.cards.TABLE``; a folder's card is a row of its configs (``fv_wan.folder``).
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
    ParallelismContract,
    ParitySpec,
    PrecisionContract,
    ProgramSpec,
    RecipeSpec,
    StepCostModel,
    StepsContract,
)
from fv_core.extend import KV_POLICY
from fv_core.loop import LoopKind, WorkUnitKind

T2V_TASKS = ("t2v", "t2i")
I2V_TASKS = ("i2v",)
TI2V_TASKS = ("t2v", "t2i", "i2v")
SCHEDULERS = ["UniPCMultistepScheduler", "FlowMatchEulerDiscreteScheduler"]  # the samplers fv runs

# What every Wan request defaults to unless its card says otherwise (diffusers' WanPipeline defaults).
# ``sampler`` and ``flow_shift`` follow the checkpoint's scheduler unless a card sets them (fv_wan.folder).
BASE_DEFAULTS = dict(
    negative_prompt="",
    num_frames=81,
    height=480,
    width=832,
    num_inference_steps=50,
    guidance_scale=5.0,
    max_sequence_length=512,
    cfg_mode="two_forward",
    fps=16,
)

# optional component -> (kind, loader): only the cards whose folders list them have them
OPTIONAL = {
    "transformer_2": ("dit", "diffusers:WanTransformer3DModel"),
    "image_encoder": ("image_encoder", "transformers:CLIPVisionModel"),
    "image_processor": ("image_processor", "transformers:CLIPImageProcessor"),
}


def architecture(
    layers: int,
    heads: int,
    head_dim: int,
    text_dim: int,
    text_layers: int,
    *,
    in_channels: int = 16,
    image_dim: int | None = None,
    z_dim: int = 16,
    spatial: int = 8,
) -> dict[str, dict]:
    """Config values a named card requires of its folder (checked at load, before any weight)."""
    dit = dict(
        _class_name="WanTransformer3DModel",
        num_layers=layers,
        num_attention_heads=heads,
        attention_head_dim=head_dim,
        text_dim=text_dim,
        in_channels=in_channels,
        image_dim=image_dim,
    )
    return {
        "transformer": dit,
        "transformer_2": dit,
        "text_encoder": dict(d_model=text_dim, num_layers=text_layers),
        # Wan2.1's published VAE config omits scale_factor_spatial (diffusers' default 8)
        "vae": dict(
            _class_name="AutoencoderKLWan",
            z_dim=z_dim,
            **({"scale_factor_spatial": spatial} if spatial != 8 else {}),
        ),
        "scheduler": dict(_class_name=SCHEDULERS),
    }


@dataclass(frozen=True)
class Size:
    """What a card states about its model's size: ``config``, what its folder must hold
    (``architecture``); the step cost; the largest request; ``kv_capacity``, the prompts whose per-block
    text keys/values stay cached (blocks x 2 x 512 x dim each)."""

    config: dict[str, dict] | None
    cost: StepCostModel
    max_frames: int | None
    max_resolution: tuple[int, int] | None
    kv_capacity: int


@dataclass(frozen=True)
class Row:
    """One card. ``defaults``: its request defaults over ``BASE_DEFAULTS``; ``weights``: ``module:attr``
    of its default folder; ``timesteps``: a distilled student's fixed steps (loop ``dmd<n>``, sampler
    ``dmd``, no CFG); ``kv_bytes``: a causal card's KV pool (loop ``causal``, ``timesteps`` per chunk);
    ``recipe``: ``RecipeSpec`` fields over its loop's; ``interceptors``: the skips it accepts; ``repo``: the
    Hugging Face repo of its published weights."""

    id: str
    description: str
    size: Size
    defaults: dict[str, Any] = field(default_factory=dict)
    tasks: tuple[str, ...] = T2V_TASKS
    optional: tuple[str, ...] = ()
    weights: str | None = None
    timesteps: tuple[int, ...] = ()
    kv_bytes: int = 0
    recipe: dict[str, Any] = field(default_factory=dict)
    # many steps: cached block spans stay close to computed ones
    interceptors: frozenset[str] = frozenset({"step_skip", "block_skip"})
    repo: str | None = None  # the Hugging Face repo publishing its weights (``ModelCard.weights_repo``)


def build(row: Row) -> ModelCard:
    """The card of ``row``."""
    causal = row.kv_bytes > 0
    pipeline = "WanImageToVideoPipeline" if row.tasks == I2V_TASKS else "WanPipeline"
    loops = _loops(row)
    text_loop = next((loop for loop in loops if loop != "i2v"), "t2v")
    defaults = row.defaults
    if row.timesteps:  # fixed steps: the dmd sampler, no CFG
        defaults = {
            "guidance_scale": 1.0,
            "sampler": "dmd",
            "num_inference_steps": len(row.timesteps),
            **defaults,
        }
    caches = {
        "text_embeddings": _cache(
            "feature", "text_encoder", ["content_hash", "max_length", "precision", "adapters"]
        ),
        "text_kv": _cache(
            "kv",
            "transformer",
            ["content_hash", "max_length", "precision", "text_encoder_version", "adapters"],
            capacity=row.size.kv_capacity,
        ),
    }
    parity = ParitySpec(
        level="C1", reference=f"diffusers:{pipeline}", tolerances={"frames": 1e-5, "frames_batched_cfg": 1e-4}
    )
    if causal:
        caches["causal_kv"] = _cache(
            "kv", "transformer", ["precision"], capacity=1 << 20, max_bytes=row.kv_bytes
        )
        parity = ParitySpec(
            level="C1",
            reference="fv_wan.causal_reference:recompute_generate",  # the same model by full recompute
            # latents: cached vs recomputed differ by float rounding (~5e-7); the VAE amplifies it ~30x
            tolerances={"latents": 1e-5, "frames": 5e-5, "frames_batched": 2e-4},
        )
    components = _components(row.size.config or {}, row.tasks, row.optional)
    return ModelCard(
        model_id=row.id,
        family="wan",
        description=row.description,
        programs=_programs(row.tasks, text_loop, defaults),
        components=components,
        loops=loops,
        recipe=RecipeSpec(**{**_recipe(row), **row.recipe, "assumes_loop": next(iter(loops))}),
        pipeline=pipeline,
        # blocks run through fv's attention seam: any kernel; a packed_attention kernel packs requests of
        # different sizes and frame counts into one step (fv_wan.packed)
        accepts_kernels={"attention": ["*"], "packed_attention": ["*"]},
        # LoRA files as diffusers reads them for Wan (its own, original Wan's, musubi's), per request
        adapters=AdapterContract(
            loader="diffusers.loaders.lora_pipeline:WanLoraLoaderMixin",
            components=[c for c in ("transformer", "transformer_2", "text_encoder") if c in components],
        ),
        parity=parity,
        capabilities=CapabilityMatrix(
            # a KV policy may pick a causal loop's cached context; no step or block reuse there
            interceptors={KV_POLICY} if causal else set(row.interceptors),
            max_frames=row.size.max_frames,
            max_resolution=row.size.max_resolution,
        ),
        caches=caches,
        precision=PrecisionContract(supported=["float32", "bfloat16"], default="float32"),
        # Ulysses over up to 8 ranks (the heads must divide), the two CFG branches on two ranks
        parallelism=ParallelismContract(axes={"dp": 1, "sp": 8, "cfgp": 2}),
        default_weights=row.weights,
        weights_repo=row.repo,
        instance_factory="fv_wan.model:CausalWanModel" if causal else "fv_wan.model:WanModel",
    )


def _loops(row: Row) -> dict[str, LoopSpec]:
    """The card's loops: ``causal``; a student's ``dmd<n>``; else ``t2v`` and/or ``i2v`` (a variant of
    ``t2v`` on a card with both: the same weights and recipe)."""
    cost, steps = row.size.cost, len(row.timesteps)
    if steps:
        fixed = StepsContract(min_steps=steps, max_steps=steps, fixed_timesteps=list(row.timesteps))
        if not row.kv_bytes:
            return {f"dmd{steps}": _loop(fixed, ["dmd"], cost)}
        causal = LoopSpec(
            kind=LoopKind.CHUNK_ROLLOUT,
            work_unit_kind=WorkUnitKind.DIFFUSION_STEP,
            loop_factory="fv_wan.causal_loop:CausalWanLoop",
            components=["tokenizer", "text_encoder", "transformer", "vae", "scheduler"],
            cache_policy=["text_embeddings", "text_kv", "causal_kv"],
            step_cost=cost,
            steps=fixed,
            samplers=["dmd"],
            params="fv_wan.params:CausalWanParams",
        )
        return {"causal": causal}
    loops, any_steps, samplers = {}, StepsContract(min_steps=1, max_steps=200), ["unipc", "euler"]
    if "t2v" in row.tasks:
        loops["t2v"] = _loop(any_steps, samplers, cost, optional=row.optional)
    if "i2v" in row.tasks:
        variant_of = next(iter(loops), None)
        loops["i2v"] = _loop(
            any_steps, samplers, cost, optional=row.optional, image=True, variant_of=variant_of
        )
    return loops


def _loop(
    steps: StepsContract,
    samplers: list[str],
    cost: StepCostModel,
    *,
    optional: tuple[str, ...] = (),
    image: bool = False,
    variant_of: str | None = None,
) -> LoopSpec:
    """The Wan loop; ``image``: the ``i2v`` loop, which takes one image part."""
    return LoopSpec(
        kind=LoopKind.DIFFUSION_DENOISE,
        work_unit_kind=WorkUnitKind.DIFFUSION_STEP,
        loop_factory="fv_wan.t2v_loop:WanLoop",
        components=["tokenizer", "text_encoder", "transformer", "vae", "scheduler", *optional],
        cache_policy=["text_embeddings", "text_kv"],
        step_cost=cost,
        steps=steps,
        samplers=samplers,
        params="fv_wan.params:WanParams",
        accepts=["image"] if image else [],
        requires=["image"] if image else [],
        variant_of=variant_of,
    )


def _recipe(row: Row) -> dict[str, Any]:
    """The recipe of the row's kind of loop, before the row's own fields."""
    if row.kv_bytes:
        steps = list(row.timesteps)
        return dict(
            method="self_forcing",
            description=f"causal (chunk-autoregressive) Wan: {len(steps)} fixed steps {steps} per chunk, "
            "no CFG, the clean chunk re-run into the KV cache at the context timestep",
        )
    return dict(method="base", description="Wan flow-matching pretraining")


def _programs(tasks: tuple[str, ...], loop: str, defaults: dict[str, Any]) -> dict[str, ProgramSpec]:
    """The card's tasks (the first is the default) with its defaults: ``t2v``, ``t2i`` (one frame) on
    the text loop ``loop`` and ``i2v`` (the video starts from the request's image)."""
    merged = {**BASE_DEFAULTS, **defaults}
    every = {
        "t2v": ProgramSpec(stages=[loop], defaults=merged, outputs=["video"], description="text to video"),
        "t2i": ProgramSpec(
            stages=[loop],
            defaults={**merged, "num_frames": 1},
            outputs=["image"],
            description="text to image",
        ),
        "i2v": ProgramSpec(
            stages=["i2v"], defaults=merged, outputs=["video"], description="image (and text) to video"
        ),
    }
    return {task: every[task] for task in tasks}


def _components(
    config: dict[str, dict], tasks: tuple[str, ...], optional: tuple[str, ...]
) -> dict[str, ComponentSpec]:
    """Wan's five components in the diffusers layout plus the ``optional`` ones the variant has. A folder
    may keep some of them in its parent's folder (model_index.json's ``_fv_shared``:
    ``fv_core.weights.component_folder``)."""

    def spec(kind: str, load_id: str, folder: str) -> ComponentSpec:
        return ComponentSpec(
            kind=kind,
            load_id=load_id,
            subfolder=folder,
            required_for=set(tasks),
            resident_for=set(tasks),
            config=config.get(folder, {}),
        )

    return {
        "tokenizer": spec("tokenizer", "transformers:AutoTokenizer", "tokenizer"),
        "text_encoder": spec("text_encoder", "transformers:UMT5EncoderModel", "text_encoder"),
        "transformer": spec("dit", "diffusers:WanTransformer3DModel", "transformer"),
        "vae": spec("vae", "diffusers:AutoencoderKLWan", "vae"),
        "scheduler": spec("scheduler", "fv_wan.samplers:make_sampler", "scheduler"),
        **{name: spec(*OPTIONAL[name], name) for name in optional},
    }


def _cache(kind: str, component: str, keys: list[str], **limits: int) -> CacheContract:
    """A cache of ``component``'s outputs keyed by the model, the component, its weights and ``keys``."""
    return CacheContract(
        kind=kind, component=component, key_fields=["model", "component", "weights_version", *keys], **limits
    )
