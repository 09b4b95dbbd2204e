"""Model cards: Wan2.1 T2V (tiny, shapes, 1.3B, 14B), the shapes model's DMD2 students (1 and 2 steps)
and its DiffusionNFT fine-tune, FastWan 1.3B (DMD2, 3 steps), Wan2.1 I2V 14B
(480p, 720p), Wan2.2 TI2V-5B and Wan2.2 A14B (T2V, I2V), plus tiny random-weight cards of each variant,
and causal Wan (chunked autoregressive, block-causal attention with a rolling KV cache) at tiny size."""

from __future__ import annotations

from pathlib import Path

from fv_core import (
    CacheContract,
    CapabilityMatrix,
    ComponentSpec,
    LoopKind,
    LoopSpec,
    ModelCard,
    ParallelismContract,
    ParitySpec,
    PrecisionContract,
    ProgramSpec,
    RecipeSpec,
    StepCostModel,
    StepsContract,
    WorkUnitKind,
)
from fv_core.extend import KV_POLICY

T2V_TASKS = ("t2v", "t2i")
I2V_TASKS = ("i2v",)
TI2V_TASKS = ("t2v", "t2i", "i2v")
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


def programs(tasks: tuple[str, ...] = T2V_TASKS, loop: str = "t2v", **defaults) -> dict[str, ProgramSpec]:
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


# optional component -> (kind, loader): only the cards whose folders list them have them
OPTIONAL = {
    "transformer_2": ("dit", "diffusers:WanTransformer3DModel"),
    "image_encoder": ("image_encoder", "transformers:CLIPVisionModel"),
    "image_processor": ("image_processor", "transformers:CLIPImageProcessor"),
}


def components(
    config: dict[str, dict] | None = None,
    tasks: tuple[str, ...] = T2V_TASKS,
    optional: tuple[str, ...] = (),
) -> dict[str, ComponentSpec]:
    """Wan's five components in the diffusers layout plus the ``optional`` ones the variant has;
    ``config``: what each must hold (see ``architecture``). A folder may keep some of them in its
    parent's folder (model_index.json's ``_fv_shared``: ``fv_core.weights.component_folder``)."""
    config = config or {}

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


def loop_spec(
    steps: StepsContract,
    samplers: list[str],
    cost: StepCostModel,
    *,
    image: bool = False,
    optional=(),
    variant_of: str | None = None,
) -> LoopSpec:
    """The Wan loop; ``image``: the ``i2v`` loop, which takes one image part (on a card that also has
    ``t2v``, a variant of it: the same weights and recipe)."""
    return LoopSpec(
        kind=LoopKind.DIFFUSION_DENOISE,
        work_unit_kind=WorkUnitKind.DIFFUSION_STEP,
        loop_factory=LOOP_FACTORY,
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
    tasks: tuple[str, ...] = T2V_TASKS,
    optional: tuple[str, ...] = (),
) -> ModelCard:
    """``kv_capacity``: prompts whose per-block text keys/values stay cached (blocks x 2 x 512 x dim each);
    ``tasks``: the variant's tasks; ``optional``: the optional components its folder has."""
    pipeline = "WanImageToVideoPipeline" if tasks == I2V_TASKS else "WanPipeline"
    text_loop = next((loop for loop in loops if loop != "i2v"), "t2v")
    return ModelCard(
        model_id=model_id,
        family="wan",
        description=description,
        programs=programs(tasks, text_loop, **defaults),
        components=components(config, tasks, optional),
        loops=loops,
        recipe=recipe,
        pipeline=pipeline,
        accepts_kernels={"attention": ["*"]},  # blocks run through fv's attention seam: any kernel
        parity=ParitySpec(
            level="C1",
            reference=f"diffusers:{pipeline}",
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
        # Ulysses over up to 8 ranks (the heads must divide), the two CFG branches on two ranks
        parallelism=ParallelismContract(axes={"dp": 1, "sp": 8, "cfgp": 2}),
        default_weights=default_weights,
        instance_factory="fv_wan.model:WanModel",
    )


def base_card(
    model_id: str,
    description: str,
    cost: StepCostModel,
    tasks: tuple[str, ...] = T2V_TASKS,
    optional: tuple[str, ...] = (),
    **kw,
) -> ModelCard:
    """A flow-matching Wan card running the sampler of its checkpoint for any step count."""
    steps, samplers = StepsContract(min_steps=1, max_steps=200), ["unipc", "euler"]
    loops = {}
    if "t2v" in tasks:
        loops["t2v"] = loop_spec(steps, samplers, cost, optional=optional)
    if "i2v" in tasks:
        variant_of = "t2v" if loops else None
        loops["i2v"] = loop_spec(steps, samplers, cost, image=True, optional=optional, variant_of=variant_of)
    recipe = RecipeSpec(
        method="base", assumes_loop=next(iter(loops)), description="Wan flow-matching pretraining"
    )
    interceptors = {"step_skip", "block_skip"}  # many steps: cached block spans stay close to computed ones
    return wan_card(
        model_id, description, loops, recipe, interceptors=interceptors, tasks=tasks, optional=optional, **kw
    )


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


# The shapes models' size (the embedded model and its students): 9 frames of 64x64, prompts padded to 16
# tokens (captions are 6; trained so), guidance 1, a 1.0M-parameter transformer and a 2-layer UMT5.
SHAPES_REQUEST = dict(num_frames=9, height=64, width=64, guidance_scale=1.0, max_sequence_length=16)
SHAPES_SIZE = dict(
    config=architecture(layers=4, heads=4, head_dim=32, text_dim=64, text_layers=2),
    max_frames=17,
    max_resolution=(128, 128),
    kv_capacity=64,
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
        defaults=dict(SHAPES_REQUEST, num_inference_steps=30),
        **SHAPES_SIZE,
        default_weights="fv_wan.cards:shapes_weights",
    )


SHAPES_TIMESTEPS = {1: [1000], 2: [1000, 750]}  # the DMD2 students' fixed timesteps
# the students ship only their transformer: their model_index.json maps the rest to ../shapes/


def shapes_student_weights(steps: int) -> str:
    """A DMD2 student of the shapes model shipped next to its parent: its transformer and recipe."""
    return str(Path(__file__).parent / "weights" / f"shapes-{steps}step")


def shapes_1step_weights() -> str:
    return shapes_student_weights(1)


def shapes_2step_weights() -> str:
    return shapes_student_weights(2)


def shapes_student(steps: int) -> ModelCard:
    """``wan2.1-t2v-shapes-<steps>step``: the shapes model distilled by DMD2 (fv-train-dmd2) to ``steps``
    fixed timesteps; runs only the ``dmd`` sampler at exactly those steps, guidance 1."""
    timesteps, loop_id = SHAPES_TIMESTEPS[steps], f"dmd{steps}"
    cost = StepCostModel(base_s=0.004, per_token_s=4e-6)
    loop = loop_spec(
        StepsContract(min_steps=steps, max_steps=steps, fixed_timesteps=timesteps), ["dmd"], cost
    )
    recipe = RecipeSpec(
        method="dmd2",
        parents=["wan2.1-t2v-shapes"],
        assumes_loop=loop_id,
        consistency_required="C2",  # its train forward is the serve forward (the C2 gate of fv-train-dmd2)
        description=f"DMD2-distilled from wan2.1-t2v-shapes (30 UniPC steps, guidance 1) for {steps} "
        f"step{'s' if steps > 1 else ''} at timesteps {timesteps}, no CFG (configs/shapes/dmd2_{steps}step.yaml)",
    )
    return wan_card(
        f"wan2.1-t2v-shapes-{steps}step",
        f"The shapes model (wan2.1-t2v-shapes) distilled by DMD2 into a {steps}-step student: fixed timesteps "
        f"{timesteps}, sampler 'dmd', no CFG. Ships only its transformer; the VAE, text encoder, tokenizer "
        "and scheduler are its parent's files. Trained with `fv train "
        f"configs/shapes/dmd2_{steps}step.yaml` (fv-train-dmd2); quality in bench/results/dmd2_shapes.json.",
        {loop_id: loop},
        recipe,
        defaults=dict(SHAPES_REQUEST, num_inference_steps=steps, sampler="dmd"),
        **SHAPES_SIZE,
        # one or two distilled steps: nothing to skip or reuse
        interceptors=set(),
        default_weights=f"fv_wan.cards:shapes_{steps}step_weights",
    )


def wan_shapes_1step() -> ModelCard:
    return shapes_student(1)


def wan_shapes_2step() -> ModelCard:
    return shapes_student(2)


def shapes_nft_weights() -> str:
    """The shapes model after DiffusionNFT, shipped next to its parent: its transformer and recipe."""
    return str(Path(__file__).parent / "weights" / "shapes-nft")


def wan_shapes_nft() -> ModelCard:
    """``wan2.1-t2v-shapes-nft``: the shapes model fine-tuned by DiffusionNFT (fv-train-nft) with the
    shapes-detector reward; the parent's loop, samplers and defaults."""
    cost = StepCostModel(base_s=0.004, per_token_s=4e-6)
    loops = {"t2v": loop_spec(StepsContract(min_steps=1, max_steps=200), ["unipc", "euler"], cost)}
    recipe = RecipeSpec(
        method="diffusion_nft",
        parents=["wan2.1-t2v-shapes"],
        assumes_loop="t2v",
        consistency_required="C2",  # C2-free: its train forward is the serve forward (fv-train-nft's gate)
        description="DiffusionNFT from wan2.1-t2v-shapes, 90 steps: old-policy rollouts (10 UniPC steps, "
        "no CFG) on the 42 training combinations scored by fv-train-flow's shapes-detector reward "
        "(configs/shapes/nft.yaml)",
    )
    return wan_card(
        "wan2.1-t2v-shapes-nft",
        "The shapes model (wan2.1-t2v-shapes) after DiffusionNFT reinforcement with fv's shape/colour/"
        "direction detector as the reward (`fv train configs/shapes/nft.yaml`, fv-train-nft). Ships only "
        "its transformer; the VAE, text encoder, tokenizer and scheduler are its parent's files. "
        "90 NFT steps (31 min on 2 shared CPU cores). Measured (30 UniPC steps, 128 prompts; "
        "bench/results/nft_shapes.json): guidance 1 shape 0.95 (parent 0.92), held-out shape 0.92 "
        "(0.83), guidance 4 shape 0.70 (0.66), colour and direction 1.00, start spread 0.75x / 0.72x the "
        "parent's at guidance 1 / 4 (RL narrows where the object starts); the targets (0.95 / 0.90 / "
        "0.8x) are not met.",
        loops,
        recipe,
        defaults=dict(SHAPES_REQUEST, num_inference_steps=30),
        **SHAPES_SIZE,
        interceptors={"step_skip", "block_skip"},
        default_weights="fv_wan.cards:shapes_nft_weights",
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


# ---- Wan2.1 I2V, Wan2.2 TI2V-5B and A14B: the published folders, and tiny random-weight ones ----

I2V_OPTIONAL = ("image_encoder", "image_processor")
A14B_OPTIONAL = ("transformer_2",)
TINY_NOTE = (
    "at tiny size with RANDOM weights (fixed seed): outputs are noise, for tests and benchmarks. Weights are "
    "generated on first use into the fv cache."
)
TINY_DEFAULTS = dict(num_frames=5, height=32, width=32, num_inference_steps=4)


def tiny_variant(
    model_id: str,
    variant: str,
    what: str,
    tasks: tuple[str, ...],
    optional: tuple[str, ...] = (),
    defaults: dict | None = None,
    config: dict[str, dict] | None = None,
) -> ModelCard:
    """A tiny card of a Wan variant whose weights ``fv_wan.tiny`` writes in the published layout."""
    return base_card(
        model_id,
        f"{what} {TINY_NOTE}",
        StepCostModel(base_s=0.004, per_token_s=2e-6),
        tasks=tasks,
        optional=optional,
        defaults={**TINY_DEFAULTS, **(defaults or {})},
        config=config,
        max_frames=81,
        max_resolution=(512, 512),
        kv_capacity=64,
        default_weights=f"fv_wan.tiny:{variant.replace('-', '_')}_weights",
    )


def wan21_i2v_tiny() -> ModelCard:
    return tiny_variant(
        "wan2.1-i2v-tiny",
        "i2v",
        "Wan2.1 I2V architecture (CLIP image encoder, image cross-attention, first-frame latent concat)",
        I2V_TASKS,
        I2V_OPTIONAL,
        defaults=dict(max_sequence_length=512),
    )


def wan22_ti2v_tiny() -> ModelCard:
    return tiny_variant(
        "wan2.2-ti2v-tiny",
        "ti2v",
        "Wan2.2 TI2V-5B architecture (48-channel x16 VAE, per-token timesteps, text or image to video)",
        TI2V_TASKS,
        config={"vae": {"z_dim": 48, "scale_factor_spatial": 16}},
    )


def wan22_t2v_a14b_tiny() -> ModelCard:
    return tiny_variant(
        "wan2.2-t2v-a14b-tiny",
        "t2v-a14b",
        "Wan2.2 T2V A14B architecture (high- and low-noise experts, boundary 0.875)",
        T2V_TASKS,
        A14B_OPTIONAL,
    )


def wan22_i2v_a14b_tiny() -> ModelCard:
    return tiny_variant(
        "wan2.2-i2v-a14b-tiny",
        "i2v-a14b",
        "Wan2.2 I2V A14B architecture (two experts, boundary 0.9, first-frame latent concat, no CLIP)",
        I2V_TASKS,
        A14B_OPTIONAL,
    )


def published(model_id: str, description: str, cost: StepCostModel, max_frames: int = 81, **kw) -> ModelCard:
    """A card for a published Wan folder (its weights are passed with --weights)."""
    return base_card(model_id, description, cost, kv_capacity=2, max_frames=max_frames, **kw)


I2V_14B = architecture(40, 40, 128, 4096, 24, in_channels=36, image_dim=1280)
A14B_T2V = architecture(40, 40, 128, 4096, 24)
A14B_I2V = architecture(40, 40, 128, 4096, 24, in_channels=36)
TI2V_5B = architecture(30, 24, 128, 4096, 24, in_channels=48, z_dim=48, spatial=16)
COST_14B = StepCostModel(base_s=0.05, per_token_s=4e-5, peak_bytes_per_token=120_000)


def wan21_i2v_480p() -> ModelCard:
    return published(
        "wan2.1-i2v-14b-480p",
        "Wan2.1 image-to-video 14B at 480p (Wan-AI/Wan2.1-I2V-14B-480P-Diffusers layout; pass --weights and "
        "--image).",
        COST_14B,
        tasks=I2V_TASKS,
        optional=I2V_OPTIONAL,
        defaults=dict(num_inference_steps=40),
        config=I2V_14B,
        max_resolution=(480, 832),
    )


def wan21_i2v_720p() -> ModelCard:
    return published(
        "wan2.1-i2v-14b-720p",
        "Wan2.1 image-to-video 14B at 720p (Wan-AI/Wan2.1-I2V-14B-720P-Diffusers layout; pass --weights and "
        "--image).",
        COST_14B,
        tasks=I2V_TASKS,
        optional=I2V_OPTIONAL,
        defaults=dict(num_inference_steps=40, height=720, width=1280),
        config=I2V_14B,
        max_resolution=(720, 1280),
    )


def wan22_ti2v_5b() -> ModelCard:
    return published(
        "wan2.2-ti2v-5b",
        "Wan2.2 text/image-to-video 5B, 720p at 24 fps (Wan-AI/Wan2.2-TI2V-5B-Diffusers layout; pass "
        "--weights, and --image for i2v).",
        StepCostModel(base_s=0.03, per_token_s=2e-5, peak_bytes_per_token=60_000),
        tasks=TI2V_TASKS,
        defaults=dict(height=704, width=1280, num_frames=121, fps=24),
        config=TI2V_5B,
        max_frames=121,
        max_resolution=(704, 1280),
    )


def wan22_t2v_a14b() -> ModelCard:
    return published(
        "wan2.2-t2v-a14b",
        "Wan2.2 text-to-video A14B: high- and low-noise 14B experts (Wan-AI/Wan2.2-T2V-A14B-Diffusers "
        "layout; pass --weights).",
        COST_14B,
        optional=A14B_OPTIONAL,
        defaults=dict(
            height=720, width=1280, num_inference_steps=40, guidance_scale=4.0, guidance_scale_2=3.0
        ),
        config=A14B_T2V,
        max_resolution=(720, 1280),
    )


def wan22_i2v_a14b() -> ModelCard:
    return published(
        "wan2.2-i2v-a14b",
        "Wan2.2 image-to-video A14B: high- and low-noise 14B experts (Wan-AI/Wan2.2-I2V-A14B-Diffusers "
        "layout; pass --weights and --image).",
        COST_14B,
        tasks=I2V_TASKS,
        optional=A14B_OPTIONAL,
        defaults=dict(
            height=720, width=1280, num_inference_steps=40, guidance_scale=3.5, guidance_scale_2=3.5
        ),
        config=A14B_I2V,
        max_resolution=(720, 1280),
    )


# ---- causal Wan: chunked autoregressive generation with a rolling KV cache (fv_wan.causal) ----

CAUSAL_TIMESTEPS = [1000, 750, 500, 250]  # Self-Forcing's four fixed steps per chunk (under the flow shift)
CAUSAL_LOOP_FACTORY = "fv_wan.causal_loop:CausalWanLoop"


def causal_card(
    model_id: str,
    description: str,
    cost: StepCostModel,
    *,
    defaults: dict,
    config: dict[str, dict] | None,
    max_frames: int | None,
    max_resolution: tuple[int, int] | None,
    kv_bytes: int,
    default_weights: str | None = None,
    timesteps: list[int] = CAUSAL_TIMESTEPS,
) -> ModelCard:
    """A causal Wan card on a Wan T2V folder: loop ``causal`` runs the fixed ``timesteps`` per chunk;
    ``defaults`` hold the chunking (``chunk_frames``, ``context_timestep``, ``window_frames``,
    ``sink_frames``: fv_wan.causal.CausalWanParams); ``kv_bytes``: the paged KV pool of its chunks'
    keys/values (resident whole; admission reserves each request's window of pages)."""
    loop = LoopSpec(
        kind=LoopKind.CHUNK_ROLLOUT,
        work_unit_kind=WorkUnitKind.DIFFUSION_STEP,
        loop_factory=CAUSAL_LOOP_FACTORY,
        components=["tokenizer", "text_encoder", "transformer", "vae", "scheduler"],
        cache_policy=["text_embeddings", "text_kv", "causal_kv"],
        step_cost=cost,
        steps=StepsContract(min_steps=len(timesteps), max_steps=len(timesteps), fixed_timesteps=timesteps),
        samplers=["dmd"],
        params="fv_wan.causal:CausalWanParams",
    )
    recipe = RecipeSpec(
        method="self_forcing",
        assumes_loop="causal",
        description=f"causal (chunk-autoregressive) Wan: {len(timesteps)} fixed steps {timesteps} per chunk, "
        "no CFG, the clean chunk re-run into the KV cache at the context timestep",
    )
    card = wan_card(
        model_id,
        description,
        {"causal": loop},
        recipe,
        defaults=dict(guidance_scale=1.0, sampler="dmd", **defaults),
        config=config,
        max_frames=max_frames,
        max_resolution=max_resolution,
        kv_capacity=64,
        interceptors={KV_POLICY},  # a KV policy may pick the cached context; no step or block reuse
        default_weights=default_weights,
        tasks=("t2v",),
    )
    caches = dict(card.caches)
    caches["causal_kv"] = CacheContract(
        kind="kv",
        component="transformer",
        key_fields=["model", "component", "weights_version", "precision"],
        capacity=1 << 20,
        max_bytes=kv_bytes,
    )
    parity = ParitySpec(
        level="C1",
        reference="fv_wan.causal:recompute_generate",  # the same causal model by full recompute, no cache
        # latents: cached vs recomputed differ by float rounding (~5e-7); the VAE amplifies it ~30x
        tolerances={"latents": 1e-5, "frames": 5e-5, "frames_batched": 2e-4},
    )
    return card.model_copy(
        update={"caches": caches, "parity": parity, "instance_factory": "fv_wan.causal:CausalWanModel"}
    )


def wan_tiny_causal() -> ModelCard:
    return causal_card(
        "wan2.1-t2v-tiny-causal",
        "Causal (chunk-autoregressive) Wan2.1 T2V on the tiny RANDOM-weight checkpoint of wan2.1-t2v-tiny: "
        "block-causal attention over chunks of 1 latent frame, 4 fixed steps per chunk, a rolling KV "
        "cache of 3 frames keeping 1 sink frame; outputs are noise, for tests and demos.",
        StepCostModel(base_s=0.004, per_token_s=2e-6),
        defaults=dict(
            num_frames=9,
            height=32,
            width=32,
            num_inference_steps=len(CAUSAL_TIMESTEPS),
            flow_shift=5.0,
            chunk_frames=1,
            context_timestep=0,
            window_frames=3,
            sink_frames=1,
        ),
        config=architecture(layers=2, heads=2, head_dim=16, text_dim=32, text_layers=2),
        max_frames=81,
        max_resolution=(512, 512),
        kv_bytes=8 << 20,
        default_weights="fv_wan.tiny:tiny_weights",
    )


def shapes_causal_weights() -> str:
    """The self-forcing causal student of the shapes model, shipped next to its parent: its transformer
    and recipe (model_index.json maps the VAE, text encoder, tokenizer and scheduler to ../shapes/)."""
    return str(Path(__file__).parent / "weights" / "shapes-causal")


# the causal shapes student's request defaults: 9 frames (3 latent frames) made one latent frame per chunk;
# the window holds 3 latent frames (the whole 9-frame clip, so a 17-frame rollout rolls it, keeping frame 0)
SHAPES_CAUSAL_DEFAULTS = dict(
    {k: v for k, v in SHAPES_REQUEST.items() if k != "guidance_scale"},  # causal_card pins guidance 1
    num_inference_steps=len(CAUSAL_TIMESTEPS),
    flow_shift=3.0,
    chunk_frames=1,
    context_timestep=0,
    window_frames=3,
    sink_frames=1,
)


def wan_shapes_causal() -> ModelCard:
    """``wan2.1-t2v-shapes-causal``: the shapes model made causal (chunk by chunk, one latent frame each)
    by self-forcing (fv-train-self-forcing) against the bidirectional wan2.1-t2v-shapes teacher."""
    card = causal_card(
        "wan2.1-t2v-shapes-causal",
        "The shapes model (wan2.1-t2v-shapes) made causal by self-forcing (`fv train "
        "configs/shapes/self_forcing.yaml`, fv-train-self-forcing): one latent frame (4 video frames) per "
        "chunk, 4 fixed steps [1000, 750, 500, 250] per chunk under flow shift 3, no CFG, each finished "
        "chunk re-run into a rolling KV cache of 3 latent frames (frame 0 kept as a sink). Ships only its "
        "transformer; the VAE, text encoder, tokenizer and scheduler are its parent's files. 12750 steps in "
        "four stages (configs/shapes/self_forcing.yaml, self_forcing_stage2.yaml, self_forcing_stage3.yaml, "
        "self_forcing_stage4.yaml, whose regression onto the teacher's ODE sits beside DMD; 84 min on 2 "
        "shared CPU cores). Measured on all 48 prompts x 2 seeds at 9 frames "
        "(bench/results/self_forcing_shapes.json): colour 1.00, shape 0.917, direction 1.00 (teacher "
        "1.00 / 0.99 / 1.00), start spread 1.64 (teacher 2.02); at 17 frames direction holds but colour and "
        "shape fail past frame 9, as the shapes VAE does on ground-truth clips past its 9 training frames.",
        StepCostModel(base_s=0.004, per_token_s=4e-6),
        defaults=SHAPES_CAUSAL_DEFAULTS,
        config=SHAPES_SIZE["config"],
        max_frames=SHAPES_SIZE["max_frames"],
        max_resolution=SHAPES_SIZE["max_resolution"],
        kv_bytes=4 << 20,
        default_weights="fv_wan.cards:shapes_causal_weights",
    )
    recipe = card.recipe.model_copy(
        update={
            "parents": ["wan2.1-t2v-shapes"],
            "consistency_required": "C2",  # its train forward is the causal loop's chunk body (the C2 gate)
            "description": "self-forcing from wan2.1-t2v-shapes (30 UniPC steps, guidance 1): the student "
            "rolls out chunk by chunk on its own KV context, DMD against the bidirectional teacher "
            "(configs/shapes/self_forcing.yaml)",
        }
    )
    return card.model_copy(update={"recipe": recipe})


CARDS = (
    wan_tiny,
    wan_shapes,
    wan_shapes_1step,
    wan_shapes_2step,
    wan_shapes_nft,
    wan_1_3b,
    wan_14b,
    fastwan_1_3b,
    wan21_i2v_tiny,
    wan22_ti2v_tiny,
    wan22_t2v_a14b_tiny,
    wan22_i2v_a14b_tiny,
    wan21_i2v_480p,
    wan21_i2v_720p,
    wan22_ti2v_5b,
    wan22_t2v_a14b,
    wan22_i2v_a14b,
    wan_tiny_causal,
    wan_shapes_causal,
)
