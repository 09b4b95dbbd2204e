"""LTX-2 cards: the base (dev) and distilled checkpoints in the published diffusers layout, and the
tiny random-weight one written in that layout for tests and demos."""

from __future__ import annotations

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
from fv_core.loop import LoopKind, WorkUnitKind
from fv_ltx2.program import GUIDANCE_OFF

TASKS = {"t2av", "t2av-two-stage", "i2av"}
# The sigmas LTX-2's distilled weights were made for (8 steps; diffusers' DISTILLED_SIGMA_VALUES), and
# the refine stage's subset (diffusers' STAGE_2_DISTILLED_SIGMA_VALUES).
DISTILLED_SIGMAS = [1.0, 0.99375, 0.9875, 0.98125, 0.975, 0.909375, 0.725, 0.421875]
REFINE_SIGMAS = DISTILLED_SIGMAS[5:]
REFINE_LORA = "ltx-2-19b-distilled-lora-384.safetensors"  # the file Lightricks/LTX-2 ships for the refine
# The prompt keys/values cache of the published checkpoints: a prompt row's are ~1.2 GB in bf16 (48 blocks,
# 1024 text tokens, key and value of the 4096-wide video and 2048-wide audio attentions), so 4 rows.
REAL_KV_BYTES = 5 << 30

# diffusers' LTX2Pipeline.__call__ defaults.
BASE_DEFAULTS = dict(
    negative_prompt="",
    num_frames=121,
    height=512,
    width=768,
    fps=24.0,
    num_inference_steps=30,
    sigmas=None,
    guidance_scale=3.0,
    stg_scale=1.0,
    modality_scale=3.0,
    guidance_rescale=0.7,
    audio_guidance_scale=7.0,
    audio_stg_scale=1.0,
    audio_modality_scale=3.0,
    audio_guidance_rescale=0.7,
    spatio_temporal_guidance_blocks=[28],
    use_cross_timestep=True,
    decode_timestep=0.0,
    max_sequence_length=1024,
)

# subfolder -> (kind, class): the components of an LTX2Pipeline folder, and its latent upsampler.
LAYOUT = {
    "tokenizer": ("tokenizer", "transformers:AutoTokenizer"),
    "text_encoder": ("text_encoder", "transformers:Gemma3ForConditionalGeneration"),
    "connectors": ("connector", "diffusers.pipelines.ltx2.connectors:LTX2TextConnectors"),
    "transformer": ("dit", "diffusers:LTX2VideoTransformer3DModel"),
    "vae": ("vae", "diffusers:AutoencoderKLLTX2Video"),
    "audio_vae": ("vae", "diffusers:AutoencoderKLLTX2Audio"),
    "vocoder": ("vocoder", "diffusers.pipelines.ltx2.vocoder:LTX2Vocoder"),
    "scheduler": ("scheduler", "diffusers:FlowMatchEulerDiscreteScheduler"),
    "latent_upsampler": ("upsampler", "diffusers.pipelines.ltx2.latent_upsampler:LTX2LatentUpsamplerModel"),
}
# what a named card requires of its folder: the published classes (sizes only for the tiny card)
CLASSES = {
    name: {"_class_name": load_id.rpartition(":")[2]}
    for name, (kind, load_id) in LAYOUT.items()
    if kind not in ("tokenizer", "text_encoder")
}


def components(config: dict[str, dict] | None = None, refine_lora: bool = True) -> dict[str, ComponentSpec]:
    """The LTX-2 components; ``config``: what each component's config must hold (default: its class);
    ``refine_lora``: the two-stage refine runs the distilled LoRA when the folder ships it."""
    config = config if config is not None else CLASSES
    specs = {
        name: ComponentSpec(
            kind=kind,
            load_id=load_id,
            subfolder=name,
            required_for={"t2av-two-stage"} if name == "latent_upsampler" else TASKS,
            config=config.get(name, {}),
        )
        for name, (kind, load_id) in LAYOUT.items()
    }
    if refine_lora:  # a file at the folder's top level, read by diffusers' LTX-2 LoRA loader
        specs["refine_lora"] = ComponentSpec(
            kind="lora",
            load_id="diffusers.loaders.lora_pipeline:LTX2LoraLoaderMixin",
            subfolder=REFINE_LORA,
            optional_for={"t2av-two-stage"},
        )
    return specs


def ltx2_card(
    model_id: str,
    description: str,
    recipe: RecipeSpec,
    cost: StepCostModel,
    *,
    defaults: dict,
    config: dict[str, dict] | None = None,
    max_frames: int | None = 257,
    max_resolution: tuple[int, int] | None = (1088, 1920),
    default_weights: str | None = None,
    interceptors: frozenset[str] = frozenset({"step_skip", "block_skip"}),
    refine_lora: bool = True,
    weights_repo: str | None = None,
    kv_bytes: int = 64 << 20,
) -> ModelCard:
    def denoise(factory: str, **kw) -> LoopSpec:
        return LoopSpec(
            kind=LoopKind.DIFFUSION_DENOISE,
            work_unit_kind=WorkUnitKind.DIFFUSION_STEP,
            loop_factory=factory,
            components=[n for n in LAYOUT if n != "latent_upsampler"],
            cache_policy=["text_embeddings", "text_kv"],
            step_cost=cost,
            # LTX-2's schedule stretches to a terminal sigma: one step would divide by zero (NaN frames)
            steps=StepsContract(min_steps=2, max_steps=200),
            samplers=["euler"],
            **{"params": "fv_ltx2.params:LTX2Params", **kw},
        )

    loops = {
        "t2av": denoise("fv_ltx2.t2av_loop:LTX2Loop"),
        "upsample": LoopSpec(
            kind=LoopKind.VAE_DECODE,
            work_unit_kind=WorkUnitKind.VAE_TILE,
            loop_factory="fv_ltx2.upsample_loop:LTX2UpsampleLoop",
            components=["latent_upsampler"],
        ),
        "refine": denoise("fv_ltx2.refine_loop:LTX2RefineLoop", variant_of="t2av"),
        "i2av": denoise(
            "fv_ltx2.i2av_loop:LTX2ImageLoop",
            variant_of="t2av",
            accepts=["image"],
            requires=["image"],
            params="fv_ltx2.params:LTX2ImageParams",
        ),
    }
    merged = {**BASE_DEFAULTS, **defaults}
    programs = {
        "t2av": ProgramSpec(
            stages=["t2av"],
            defaults=merged,
            outputs=["video", "audio"],
            description="text to video with sound",
        ),
        "t2av-two-stage": ProgramSpec(
            stages=["t2av", "upsample", "refine"],
            params="fv_ltx2.params:LTX2TwoStageParams",
            binds={i: f"fv_ltx2.program:{f}" for i, f in enumerate(("base", "upsample", "refine"))},
            defaults={**merged, "refine_sigmas": REFINE_SIGMAS, "refine_noise_scale": None},
            outputs=["video", "audio"],
            description="base at half size, latent upsampler x2, refine on fixed sigmas with guidance off",
        ),
        "i2av": ProgramSpec(
            stages=["i2av"],
            defaults={
                **merged,
                "image_crf": 33,
            },  # the compression LTX-2 (Gemma 3 generation) was trained with
            outputs=["video", "audio"],
            description="image (the first frame) and text to video with sound",
        ),
    }
    return ModelCard(
        model_id=model_id,
        family="ltx2",
        description=description,
        components=components(config, refine_lora),
        loops=loops,
        programs=programs,
        recipe=recipe,
        parity=ParitySpec(
            level="C1", reference="diffusers:LTX2Pipeline", tolerances={"frames": 1e-5, "audio": 1e-5}
        ),
        capabilities=CapabilityMatrix(
            interceptors=set(interceptors), max_frames=max_frames, max_resolution=max_resolution
        ),
        caches={
            "text_embeddings": CacheContract(
                kind="feature",
                component="connectors",
                key_fields=[
                    "model",
                    "component",
                    "weights_version",
                    "content_hash",
                    "max_length",
                    "precision",
                    "text_encoder_version",
                    "adapters",
                ],
                capacity=64,
            ),
            # each prompt row's keys/values of every block's text cross-attention (fv_ltx2.prompt_kv)
            "text_kv": CacheContract(
                kind="kv",
                component="transformer",
                key_fields=[
                    "model",
                    "component",
                    "weights_version",
                    "content_hash",
                    "max_length",
                    "precision",
                    "text_encoder_version",
                    "connectors_version",
                    "adapters",
                ],
                capacity=64,
                max_bytes=kv_bytes,
            ),
        },
        precision=PrecisionContract(supported=["float32", "bfloat16"], default="float32"),
        # LoRA files as diffusers' LTX-2 loader reads them (its own format, LTX-2's ``diffusion_model.`` /
        # ``text_embedding_projection.`` keys), per request: the transformer (video and audio streams),
        # the text connectors, and Gemma (diffusers-format ``text_encoder.`` keys)
        adapters=AdapterContract(
            loader="diffusers.loaders.lora_pipeline:LTX2LoraLoaderMixin",
            components=["transformer", "connectors", "text_encoder"],
        ),
        # Ulysses over up to 8 ranks (LTX-2's 32 video and 32 audio heads), the cfg call's rows over 2
        parallelism=ParallelismContract(axes={"dp": 1, "sp": 8, "cfgp": 2}),
        pipeline="LTX2Pipeline",
        default_weights=default_weights,
        weights_repo=weights_repo,
        instance_factory="fv_ltx2.model:LTX2Model",
    )


BASE_RECIPE = RecipeSpec(
    method="base", assumes_loop="t2av", description="LTX-2 joint audio+video flow matching"
)


def ltx2_tiny() -> ModelCard:
    from fv_ltx2.tiny import tiny_config

    return ltx2_card(
        "ltx2-tiny",
        "LTX-2 architecture at tiny size with RANDOM weights (fixed seed): its video and audio are noise, "
        "for tests, demos and benchmarks. Written on first use into the fv cache in the published layout.",
        BASE_RECIPE,
        StepCostModel(base_s=0.01, per_token_s=1e-5),
        defaults=dict(
            num_frames=9,
            height=64,
            width=64,
            num_inference_steps=4,
            spatio_temporal_guidance_blocks=[1],
            max_sequence_length=128,
        ),  # fmt: skip
        config=tiny_config(),
        max_frames=121,
        max_resolution=(512, 512),
        default_weights="fv_ltx2.tiny:tiny_weights",
    )


def ltx2_dev() -> ModelCard:
    return ltx2_card(
        "ltx-2",
        "LTX-2 joint audio+video, base (dev) weights (Lightricks/LTX-2 diffusers layout, fetched by its Hugging "
        "Face id).",
        BASE_RECIPE,
        StepCostModel(base_s=0.05, per_token_s=4e-5, peak_bytes_per_token=150_000),
        defaults={},
        weights_repo="Lightricks/LTX-2",
        kv_bytes=REAL_KV_BYTES,
    )


def ltx2_distilled() -> ModelCard:
    recipe = RecipeSpec(
        method="distillation",
        parents=["ltx-2"],
        assumes_loop="t2av",
        description=f"LTX-2 distilled for 8 steps at sigmas {DISTILLED_SIGMAS} (through the folder's scheduler "
        "config, as diffusers runs them), guidance off",
    )
    return ltx2_card(
        "ltx-2-distilled",
        "LTX-2 distilled weights (8 steps at fixed sigmas, no guidance; Lightricks/LTX-2 diffusers layout "
        "with the distilled transformer; pass --weights).",
        recipe,
        StepCostModel(base_s=0.05, per_token_s=4e-5, peak_bytes_per_token=150_000),
        defaults=dict(num_inference_steps=8, sigmas=DISTILLED_SIGMAS, **GUIDANCE_OFF),
        kv_bytes=REAL_KV_BYTES,
    )
