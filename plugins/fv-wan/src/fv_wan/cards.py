"""Model cards: Wan2.1 T2V (tiny, shapes, 1.3B, 14B) and FastWan 1.3B (DMD2, 3 steps)."""

from __future__ import annotations

from pathlib import Path

from fv_core import (
    CacheContract,
    CapabilityMatrix,
    ComponentSpec,
    LoopKind,
    LoopSpec,
    ModelCard,
    ParitySpec,
    PrecisionContract,
    ProgramSpec,
    RecipeSpec,
    StepCostModel,
    StepsContract,
    WorkUnitKind,
)

TASKS = {"t2v", "t2i"}
LOOP_FACTORY = "fv_wan.loop:WanLoop"
FASTWAN_TIMESTEPS = [1000, 757, 522]
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


def programs(**defaults) -> dict[str, ProgramSpec]:
    """``t2v`` (the default task) and ``t2i`` (one frame) on the card's loop, with its defaults."""
    loop = "dmd3" if defaults.get("sampler") == "dmd" else "t2v"
    merged = {**BASE_DEFAULTS, **defaults}
    return {
        "t2v": ProgramSpec(stages=[loop], defaults=merged, outputs=["video"], description="text to video"),
        "t2i": ProgramSpec(
            stages=[loop],
            defaults={**merged, "num_frames": 1},
            outputs=["image"],
            description="text to image",
        ),
    }


def architecture(layers: int, heads: int, head_dim: int, text_dim: int, text_layers: int) -> dict[str, dict]:
    """Config values a named card requires of its folder (checked at load, before any weight)."""
    return {
        "transformer": dict(
            _class_name="WanTransformer3DModel",
            num_layers=layers,
            num_attention_heads=heads,
            attention_head_dim=head_dim,
            text_dim=text_dim,
        ),
        "text_encoder": dict(d_model=text_dim, num_layers=text_layers),
        "vae": dict(_class_name="AutoencoderKLWan", z_dim=16),
        "scheduler": dict(_class_name=SCHEDULERS),
    }


def components(config: dict[str, dict] | None = None) -> dict[str, ComponentSpec]:
    """Wan's five components in the diffusers layout; ``config``: what each must hold (see ``architecture``)."""
    config = config or {}

    def spec(kind: str, load_id: str, folder: str) -> ComponentSpec:
        return ComponentSpec(
            kind=kind,
            load_id=load_id,
            subfolder=folder,
            required_for=TASKS,
            resident_for=TASKS,
            config=config.get(folder, {}),
        )

    return {
        "tokenizer": spec("tokenizer", "transformers:AutoTokenizer", "tokenizer"),
        "text_encoder": spec("text_encoder", "transformers:UMT5EncoderModel", "text_encoder"),
        "transformer": spec("dit", "diffusers:WanTransformer3DModel", "transformer"),
        "vae": spec("vae", "diffusers:AutoencoderKLWan", "vae"),
        "scheduler": spec("scheduler", "fv_wan.samplers:make_sampler", "scheduler"),
    }


def loop_spec(steps: StepsContract, samplers: list[str], cost: StepCostModel) -> LoopSpec:
    return LoopSpec(
        kind=LoopKind.DIFFUSION_DENOISE,
        work_unit_kind=WorkUnitKind.DIFFUSION_STEP,
        loop_factory=LOOP_FACTORY,
        components=["tokenizer", "text_encoder", "transformer", "vae", "scheduler"],
        cache_policy=["text_embeddings", "text_kv"],
        step_cost=cost,
        steps=steps,
        samplers=samplers,
        params="fv_wan.params:WanParams",
    )


def wan_card(
    model_id: str,
    description: str,
    loops: dict[str, LoopSpec],
    recipe: RecipeSpec,
    *,
    defaults: dict,
    config: dict[str, dict] | None,
    max_frames: int | None,
    max_resolution: tuple[int, int] | None,
    kv_capacity: int,
    interceptors: set[str],
    default_weights: str | None = None,
) -> ModelCard:
    """``kv_capacity``: prompts whose per-block text keys/values stay cached (blocks x 2 x 512 x dim each)."""
    return ModelCard(
        model_id=model_id,
        family="wan",
        description=description,
        programs=programs(**defaults),
        components=components(config),
        loops=loops,
        recipe=recipe,
        pipeline="WanPipeline",
        parity=ParitySpec(
            level="C1",
            reference="diffusers:WanPipeline",
            tolerances={"frames": 1e-5, "frames_batched_cfg": 1e-4},
        ),
        capabilities=CapabilityMatrix(
            interceptors=interceptors, max_frames=max_frames, max_resolution=max_resolution
        ),
        caches={
            "text_embeddings": CacheContract(
                kind="feature",
                component="text_encoder",
                key_fields=[
                    "model",
                    "component",
                    "weights_version",
                    "content_hash",
                    "max_length",
                    "precision",
                ],
            ),
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
                ],
                capacity=kv_capacity,
            ),
        },
        precision=PrecisionContract(supported=["float32", "bfloat16"], default="float32"),
        default_weights=default_weights,
        instance_factory="fv_wan.model:WanModel",
    )


def base_card(model_id: str, description: str, cost: StepCostModel, **kw) -> ModelCard:
    loop = loop_spec(StepsContract(min_steps=1, max_steps=200), ["unipc", "euler"], cost)
    recipe = RecipeSpec(method="base", assumes_loop="t2v", description="Wan2.1 flow-matching pretraining")
    interceptors = {"step_skip", "block_skip"}  # many steps: cached block spans stay close to computed ones
    return wan_card(model_id, description, {"t2v": loop}, recipe, interceptors=interceptors, **kw)


def wan_tiny() -> ModelCard:
    return base_card(
        "wan2.1-t2v-tiny",
        "Wan2.1 T2V architecture at tiny size with RANDOM weights (fixed seed): outputs are noise, "
        "for tests, demos and benchmarks. Weights are generated on first use into the fv cache.",
        StepCostModel(base_s=0.004, per_token_s=2e-6),
        defaults=dict(num_frames=5, height=32, width=32, num_inference_steps=4),
        config=architecture(layers=2, heads=2, head_dim=16, text_dim=32, text_layers=2),
        max_frames=81,
        max_resolution=(512, 512),
        kv_capacity=64,
        default_weights="fv_wan.tiny:tiny_weights",
    )


def shapes_weights() -> str:
    """The trained shapes checkpoint shipped inside this package (diffusers layout, safetensors)."""
    return str(Path(__file__).parent / "weights" / "shapes")


def wan_shapes() -> ModelCard:
    return base_card(
        "wan2.1-t2v-shapes",
        "Wan2.1 T2V architecture at tiny size, TRAINED (the embedded default that shows what you ask for): "
        "9 frames at 64x64 of one circle or square in red, orange, yellow, green, blue or purple moving "
        "left, right, up or down on a dark background; prompt e.g. 'a red circle moving left'. Made by "
        "fv-train-flow on synthetic clips (fv_train_flow.shapes) on 2 CPU cores in 53 minutes: "
        "`fv train configs/shapes/vae.yaml` (AutoencoderKLWan, 2x2 patchify, 1.5M parameters), then "
        "`fv train configs/shapes/flow.yaml` (a 1.0M-parameter WanTransformer3DModel and an 83k-parameter "
        "UMT5 trained jointly by flow matching; EMA weights; prompts padded to 16 tokens). Six "
        "colour/shape/direction combinations were held out of training. Measured at the defaults (30 UniPC "
        "steps, guidance 1, 128 prompts; bench/results/train_shapes.json): colour 1.00, shape 0.92, "
        "direction 1.00; guidance 4 rounds squares (shape 0.66).",
        StepCostModel(base_s=0.004, per_token_s=4e-6),
        # captions are 6 tokens; trained with prompts padded to 16
        defaults=dict(
            num_frames=9,
            height=64,
            width=64,
            num_inference_steps=30,
            guidance_scale=1.0,
            max_sequence_length=16,
        ),
        config=architecture(layers=4, heads=4, head_dim=32, text_dim=64, text_layers=2),
        max_frames=17,
        max_resolution=(128, 128),
        kv_capacity=64,
        default_weights="fv_wan.cards:shapes_weights",
    )


WAN_1_3B = architecture(layers=30, heads=12, head_dim=128, text_dim=4096, text_layers=24)


def wan_1_3b() -> ModelCard:
    return base_card(
        "wan2.1-t2v-1.3b",
        "Wan2.1 text-to-video 1.3B (Wan-AI/Wan2.1-T2V-1.3B-Diffusers layout; pass --weights).",
        StepCostModel(base_s=0.02, per_token_s=1.5e-5, peak_bytes_per_token=40_000),
        defaults={},
        config=WAN_1_3B,
        max_frames=81,
        max_resolution=(480, 832),
        kv_capacity=8,
    )


def wan_14b() -> ModelCard:
    return base_card(
        "wan2.1-t2v-14b",
        "Wan2.1 text-to-video 14B (Wan-AI/Wan2.1-T2V-14B-Diffusers layout; pass --weights).",
        StepCostModel(base_s=0.05, per_token_s=4e-5, peak_bytes_per_token=120_000),
        defaults=dict(height=720, width=1280),
        config=architecture(layers=40, heads=40, head_dim=128, text_dim=4096, text_layers=24),
        max_frames=81,
        max_resolution=(720, 1280),
        kv_capacity=2,
    )


def fastwan_1_3b() -> ModelCard:
    loop = loop_spec(
        StepsContract(min_steps=3, max_steps=3, fixed_timesteps=FASTWAN_TIMESTEPS),
        ["dmd"],
        StepCostModel(base_s=0.02, per_token_s=1.5e-5, peak_bytes_per_token=40_000),
    )
    recipe = RecipeSpec(
        method="dmd2",
        parents=["wan2.1-t2v-1.3b"],
        assumes_loop="dmd3",
        description=f"DMD2-distilled from Wan2.1 1.3B for 3 steps at timesteps {FASTWAN_TIMESTEPS}, no CFG",
    )
    return wan_card(
        "fastwan2.1-t2v-1.3b",
        "FastWan2.1 T2V 1.3B (FastVideo/FastWan2.1-T2V-1.3B-Diffusers layout; pass --weights): "
        "3-step DMD2 sampling, no CFG.",
        {"dmd3": loop},
        recipe,
        defaults=dict(num_inference_steps=3, guidance_scale=1.0, sampler="dmd"),
        config=WAN_1_3B,
        max_frames=81,
        max_resolution=(480, 832),
        kv_capacity=8,
        # 3 distilled steps: each changes the latents too much to reuse a cached block span
        interceptors={"step_skip"},
    )


CARDS = (wan_tiny, wan_shapes, wan_1_3b, wan_14b, fastwan_1_3b)
