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
    RecipeSpec,
    StepCostModel,
    StepsContract,
    WorkUnitKind,
)

TASKS = {"text_to_video", "text_to_image", "encode_text"}
GENERATE = {"text_to_video", "text_to_image"}
LOOP_FACTORY = "fv_wan.loop:WanLoop"
FASTWAN_TIMESTEPS = [1000, 757, 522]

# Request defaults per card (the card schema has no field for them).
DEFAULTS = {
    "wan2.1-t2v-tiny": dict(num_frames=5, height=32, width=32, steps=4, guidance=5.0, sampler="unipc"),
    "wan2.1-t2v-shapes": dict(
        num_frames=9, height=64, width=64, steps=30, guidance=1.0, sampler="unipc", max_sequence_length=16
    ),  # captions are 6 tokens; trained with prompts padded to 16
    "wan2.1-t2v-1.3b": dict(num_frames=81, height=480, width=832, steps=50, guidance=5.0, sampler="unipc"),
    "wan2.1-t2v-14b": dict(num_frames=81, height=720, width=1280, steps=50, guidance=5.0, sampler="unipc"),
    "fastwan2.1-t2v-1.3b": dict(num_frames=81, height=480, width=832, steps=3, guidance=1.0, sampler="dmd"),
}


def _components() -> dict[str, ComponentSpec]:
    def spec(kind: str, load_id: str, folder: str, tasks: set[str]) -> ComponentSpec:
        return ComponentSpec(
            kind=kind, load_id=load_id, subfolder=folder, required_for=tasks, resident_for=tasks
        )

    return {
        "tokenizer": spec("tokenizer", "transformers:AutoTokenizer", "tokenizer", TASKS),
        "text_encoder": spec("text_encoder", "transformers:UMT5EncoderModel", "text_encoder", TASKS),
        "transformer": spec("dit", "diffusers:WanTransformer3DModel", "transformer", GENERATE),
        "vae": spec("vae", "diffusers:AutoencoderKLWan", "vae", GENERATE),
        "scheduler": spec("scheduler", "fv_wan.samplers:make_sampler", "scheduler", GENERATE),
    }


def _loop(steps: StepsContract, samplers: list[str], cost: StepCostModel) -> LoopSpec:
    return LoopSpec(
        kind=LoopKind.DIFFUSION_DENOISE,
        work_unit_kind=WorkUnitKind.DIFFUSION_STEP,
        loop_factory=LOOP_FACTORY,
        components=["tokenizer", "text_encoder", "transformer", "vae", "scheduler"],
        cache_policy=["text_embeddings", "text_kv"],
        step_cost=cost,
        steps=steps,
        samplers=samplers,
    )


def _card(
    model_id: str,
    description: str,
    loops: dict[str, LoopSpec],
    recipe: RecipeSpec,
    *,
    max_frames: int,
    max_resolution: tuple[int, int],
    kv_capacity: int,
    interceptors: set[str],
    default_weights: str | None = None,
) -> ModelCard:
    """``kv_capacity``: prompts whose per-block text keys/values stay cached (blocks x 2 x 512 x dim each)."""
    return ModelCard(
        model_id=model_id,
        family="wan",
        description=description,
        defaults=DEFAULTS[model_id],
        components=_components(),
        loops=loops,
        recipe=recipe,
        parity=ParitySpec(
            level="C1",
            reference="diffusers:WanPipeline",
            tolerances={"frames": 1e-5, "frames_batched_cfg": 1e-4},
        ),
        capabilities=CapabilityMatrix(
            tasks=TASKS, interceptors=interceptors, max_frames=max_frames, max_resolution=max_resolution
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


def _base(model_id: str, description: str, cost: StepCostModel, **kw) -> ModelCard:
    loop = _loop(StepsContract(min_steps=1, max_steps=200), ["unipc", "euler"], cost)
    recipe = RecipeSpec(method="base", assumes_loop="t2v", description="Wan2.1 flow-matching pretraining")
    interceptors = {"step_skip", "block_skip"}  # many steps: cached block spans stay close to computed ones
    return _card(model_id, description, {"t2v": loop}, recipe, interceptors=interceptors, **kw)


def wan_tiny() -> ModelCard:
    return _base(
        "wan2.1-t2v-tiny",
        "Wan2.1 T2V architecture at tiny size with RANDOM weights (fixed seed): outputs are noise, "
        "for tests, demos and benchmarks. Weights are generated on first use into the fv cache.",
        StepCostModel(base_s=0.004, per_token_s=2e-6),
        max_frames=81,
        max_resolution=(512, 512),
        kv_capacity=64,
        default_weights="fv_wan.tiny:tiny_weights",
    )


def shapes_weights() -> str:
    """The trained shapes checkpoint shipped inside this package (diffusers layout, safetensors)."""
    return str(Path(__file__).parent / "weights" / "shapes")


def wan_shapes() -> ModelCard:
    return _base(
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
        max_frames=17,
        max_resolution=(128, 128),
        kv_capacity=64,
        default_weights="fv_wan.cards:shapes_weights",
    )


def wan_1_3b() -> ModelCard:
    return _base(
        "wan2.1-t2v-1.3b",
        "Wan2.1 text-to-video 1.3B (Wan-AI/Wan2.1-T2V-1.3B-Diffusers layout; pass --weights).",
        StepCostModel(base_s=0.02, per_token_s=1.5e-5, peak_bytes_per_token=40_000),
        max_frames=81,
        max_resolution=(480, 832),
        kv_capacity=8,
    )


def wan_14b() -> ModelCard:
    return _base(
        "wan2.1-t2v-14b",
        "Wan2.1 text-to-video 14B (Wan-AI/Wan2.1-T2V-14B-Diffusers layout; pass --weights).",
        StepCostModel(base_s=0.05, per_token_s=4e-5, peak_bytes_per_token=120_000),
        max_frames=81,
        max_resolution=(720, 1280),
        kv_capacity=2,
    )


def fastwan_1_3b() -> ModelCard:
    loop = _loop(
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
    return _card(
        "fastwan2.1-t2v-1.3b",
        "FastWan2.1 T2V 1.3B (FastVideo/FastWan2.1-T2V-1.3B-Diffusers layout; pass --weights): "
        "3-step DMD2 sampling, no CFG.",
        {"dmd3": loop},
        recipe,
        max_frames=81,
        max_resolution=(480, 832),
        kv_capacity=8,
        # 3 distilled steps: each changes the latents too much to reuse a cached block span
        interceptors={"step_skip"},
    )


CARDS = (wan_tiny, wan_shapes, wan_1_3b, wan_14b, fastwan_1_3b)
