"""BAGEL cards: BAGEL-7B-MoT in its published layout, and the tiny random-weight one written in that
layout. Both serve ``chat`` (AR decode, images optional) and ``t2i`` (denoise) on ONE resident
network: the two loops bind the same ``net`` component."""

from __future__ import annotations

from fv_bagel.params import VAE_TRANSFORM, VIT_TRANSFORM
from fv_core.card import (
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

# BAGEL's published inference settings (inferencer.py, app.py): text generation greedy (do_sample=False);
# t2i: 50 timesteps, text CFG 4, image CFG 1, interval [0.4, 1], global renorm, shift 3.
SPECULATIVE = dict(speculative_k=0, speculative_ngram=3)  # off unless a request asks (prompt lookup)
CHAT_DEFAULTS = dict(max_tokens=512, temperature=0.0, top_p=1.0, top_k=0, stop=[], think=False, **SPECULATIVE)
T2I_DEFAULTS = dict(
    height=1024,
    width=1024,
    num_inference_steps=50,
    cfg_text_scale=4.0,
    cfg_img_scale=1.0,
    cfg_interval=(0.4, 1.0),
    cfg_renorm_type="global",
    cfg_renorm_min=0.0,
    timestep_shift=3.0,
)


TASKS = ("chat", "t2i", "think-t2i", "edit")
THINK_DEFAULTS = dict(
    max_tokens=1024, temperature=0.0, top_p=1.0, top_k=0, **SPECULATIVE
)  # app.py: max_think_token_n 1024


# edit (app.py edit_image): image CFG 2, guidance over the whole schedule, per-token text renorm
EDIT_DEFAULTS = {
    **{k: v for k, v in T2I_DEFAULTS.items() if k not in ("height", "width")},
    "cfg_img_scale": 2.0, "cfg_interval": (0.0, 1.0), "cfg_renorm_type": "text_channel",
}  # fmt: skip


# how input images are resized (BAGEL's vae_transform, then vit_transform): chat's and edit's defaults
PUBLISHED_TRANSFORMS = dict(vae_transform=VAE_TRANSFORM, vit_transform=VIT_TRANSFORM)


def components() -> dict[str, ComponentSpec]:
    return {
        "net": ComponentSpec(
            kind="mot",
            load_id="fv_bagel.net:BagelNet",
            required_for={"chat", "t2i"},
            resident_for={"chat", "t2i"},
        ),
        "tokenizer": ComponentSpec(
            kind="tokenizer", load_id="transformers:AutoTokenizer", required_for=set(TASKS)
        ),
        "vae": ComponentSpec(
            kind="vae", load_id="diffusers:AutoencoderKL", required_for=set(TASKS) - {"chat"}
        ),
    }


def bagel_card(
    model_id: str,
    description: str,
    cost: StepCostModel,
    *,
    t2i: dict,
    chat: dict | None = None,
    think: dict | None = None,
    precision: PrecisionContract,
    transforms: dict = PUBLISHED_TRANSFORMS,
    instance_factory: str = "fv_bagel.model:BagelModel",
    default_weights: str | None = None,
    max_resolution: tuple[int, int] | None = (1024, 1024),
    kv_bytes: int = 8 << 30,
    weights_repo: str | None = None,
) -> ModelCard:
    loops = {
        "chat": LoopSpec(
            kind=LoopKind.AR_DECODE,
            work_unit_kind=WorkUnitKind.AR_TOKEN,
            loop_factory="fv_bagel.chat_loop:ChatLoop",
            components=["net", "tokenizer"],
            shared_weight_components=["net"],
            step_cost=cost,
            params="fv_bagel.params:TextParams",
            accepts=["text", "image"],  # the conversation before the prompt, in order
        ),
        "t2i": LoopSpec(
            kind=LoopKind.DIFFUSION_DENOISE,
            work_unit_kind=WorkUnitKind.DIFFUSION_STEP,
            loop_factory="fv_bagel.t2i_loop:ImageLoop",
            components=["net", "tokenizer", "vae"],
            shared_weight_components=["net"],
            step_cost=cost,
            steps=StepsContract(min_steps=2, max_steps=1000),
            samplers=["euler"],
            params="fv_bagel.params:ImageParams",
        ),
        "edit": LoopSpec(  # the denoise loop over an image's context (its steps: t2i's)
            kind=LoopKind.DIFFUSION_DENOISE,
            work_unit_kind=WorkUnitKind.DIFFUSION_STEP,
            loop_factory="fv_bagel.edit_loop:EditLoop",
            components=["net", "tokenizer", "vae"],
            shared_weight_components=["net"],
            step_cost=cost,
            samplers=["euler"],
            params="fv_bagel.params:EditParams",
            variant_of="t2i",
            accepts=["image"],
            requires=["image"],
        ),
        "think": LoopSpec(  # the AR loop writing a plan into the generation context (its steps: t2i's)
            kind=LoopKind.AR_DECODE,
            work_unit_kind=WorkUnitKind.AR_TOKEN,
            loop_factory="fv_bagel.chat_loop:ChatLoop",
            components=["net", "tokenizer"],
            shared_weight_components=["net"],
            step_cost=cost,
            params="fv_bagel.params:TextParams",
            variant_of="t2i",
        ),
    }
    programs = {
        "chat": ProgramSpec(
            stages=["chat"], defaults={**CHAT_DEFAULTS, **transforms, **(chat or {})}, outputs=["text"],
            description="text (and images) in, text out: understanding and chat",
        ),
        "t2i": ProgramSpec(
            stages=["t2i"], defaults={**T2I_DEFAULTS, **t2i}, outputs=["image"], description="text to image",
        ),
        "edit": ProgramSpec(
            stages=["edit"],
            defaults={**EDIT_DEFAULTS, **transforms, **{k: v for k, v in t2i.items() if k in EDIT_DEFAULTS}},
            outputs=["image"], description="image and instruction to image (the image sets the size)",
        ),
        "think-t2i": ProgramSpec(
            stages=["think", "t2i"], params="fv_bagel.params:ThinkImageParams",
            binds={0: "fv_bagel.program:think", 1: "fv_bagel.program:image"},
            defaults={**T2I_DEFAULTS, **THINK_DEFAULTS, **t2i, **(think or {})}, outputs=["image", "text"],
            description="the AR loop plans in <think> ... </think>, then t2i: the image and the thinking",
        ),
    }  # fmt: skip
    return ModelCard(
        model_id=model_id,
        family="bagel",
        description=description,
        components=components(),
        loops=loops,
        programs=programs,
        recipe=RecipeSpec(
            method="base", assumes_loop="t2i", description="BAGEL MoT: next-token prediction + rectified flow"
        ),
        parity=ParitySpec(level="C0", reference="transformers:Qwen3DecoderLayer"),
        capabilities=CapabilityMatrix(max_resolution=max_resolution),
        caches={
            # the contexts' keys/values: a paged pool of this many bytes (resident whole); admission
            # reserves each request's worst-case pages of it (loops' kv_need)
            "kv": CacheContract(
                kind="kv",
                component="net",
                key_fields=["model", "component", "weights_version", "precision"],
                capacity=1 << 20,
                max_bytes=kv_bytes,
            )
        },
        precision=precision,
        default_weights=default_weights,
        weights_repo=weights_repo,
        instance_factory=instance_factory,
    )


def bagel_7b_mot() -> ModelCard:
    return bagel_card(
        "bagel-7b-mot",
        "BAGEL-7B-MoT (ByteDance-Seed/BAGEL-7B-MoT, published layout: ema.safetensors, ae.safetensors, "
        "llm_config.json, vit_config.json, the Qwen2 tokenizer; fetched by its Hugging Face id): chat, "
        "understanding and t2i on one resident MoT.",
        StepCostModel(base_s=0.02, per_token_s=2e-5, peak_bytes_per_token=400_000),
        t2i={},
        precision=PrecisionContract(supported=["bfloat16", "float32"], default="bfloat16"),
        weights_repo="ByteDance-Seed/BAGEL-7B-MoT",
    )


def bagel_tiny() -> ModelCard:
    return bagel_card(
        "bagel-tiny",
        "BAGEL's MoT architecture at tiny size with RANDOM weights (fixed seed): its text and images are "
        "noise, for tests, demos and benchmarks. Written on first use into the fv cache in the published "
        "layout; runs row-invariant math (batched and ragged steps equal solo runs bit for bit).",
        StepCostModel(base_s=0.005, per_token_s=1e-5),
        t2i=dict(height=64, width=64, num_inference_steps=8),
        chat=dict(max_tokens=16),
        think=dict(max_tokens=8),
        precision=PrecisionContract(supported=["float32"], default="float32"),
        transforms=dict(vae_transform=(128, 64, 16), vit_transform=(32, 16, 4)),  # its tables: 8x16, 8x4 px
        instance_factory="fv_bagel.model:exact_model",
        default_weights="fv_bagel.tiny:tiny_weights",
        max_resolution=(128, 128),
        kv_bytes=16 << 20,
    )
