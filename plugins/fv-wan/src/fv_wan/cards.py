"""Wan's cards as data: ``TABLE`` holds one ``Row`` per card (id, size, tasks, defaults, description,
weights, loop and recipe), built by the one builder, ``fv_wan.card_builder.build``. Wan2.1 T2V (tiny,
the trained shapes model, 1.3B, 14B), the shapes model's DMD2 students and its DiffusionNFT fine-tune,
FastWan 1.3B, Wan2.1 I2V 14B (480p, 720p), Wan2.2 TI2V-5B and A14B (T2V, I2V), tiny random-weight cards
of each variant, and causal Wan (tiny, and the shapes model made causal). Measured quality lives in
``bench/results`` and the README, not in descriptions.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

from fv_core import UnknownKeyError
from fv_core.card import ModelCard, StepCostModel
from fv_wan.card_builder import I2V_TASKS, T2V_TASKS, TI2V_TASKS, Row, Size, architecture, build

CAUSAL_TIMESTEPS = (1000, 750, 500, 250)  # Self-Forcing's four fixed steps per chunk (under the flow shift)
I2V_OPTIONAL = ("image_encoder", "image_processor")
A14B_OPTIONAL = ("transformer_2",)


# ---- the shipped weights ----


def shipped(name: str) -> str:
    """A folder shipped inside this package (diffusers layout, safetensors). The shapes model's students
    ship only their transformer and recipe: their model_index.json maps the rest to ../shapes/."""
    return str(Path(__file__).parent / "weights" / name)


shapes_weights = partial(shipped, "shapes")
shapes_1step_weights = partial(shipped, "shapes-1step")
shapes_2step_weights = partial(shipped, "shapes-2step")
shapes_nft_weights = partial(shipped, "shapes-nft")
shapes_causal_weights = partial(shipped, "shapes-causal")
shapes_causal_long_weights = partial(shipped, "shapes-causal-long")


# ---- the table ----

TINY_COST = StepCostModel(base_s=0.004, per_token_s=2e-6)
TINY = Size(architecture(2, 2, 16, 32, 2), TINY_COST, 81, (512, 512), 64)
TINY_VARIANT = Size(None, TINY_COST, 81, (512, 512), 64)  # its folder's configs say the rest
SHAPES = Size(
    architecture(4, 4, 32, 64, 2), StepCostModel(base_s=0.004, per_token_s=4e-6), 17, (128, 128), 64
)
COST_1_3B = StepCostModel(base_s=0.02, per_token_s=1.5e-5, peak_bytes_per_token=40_000)
COST_14B = StepCostModel(base_s=0.05, per_token_s=4e-5, peak_bytes_per_token=120_000)
WAN_1_3B = Size(architecture(30, 12, 128, 4096, 24), COST_1_3B, 81, (480, 832), 8)
WAN_14B = Size(architecture(40, 40, 128, 4096, 24), COST_14B, 81, (720, 1280), 2)
I2V_14B = architecture(40, 40, 128, 4096, 24, in_channels=36, image_dim=1280)
TI2V_5B = Size(
    architecture(30, 24, 128, 4096, 24, in_channels=48, z_dim=48, spatial=16),
    StepCostModel(base_s=0.03, per_token_s=2e-5, peak_bytes_per_token=60_000),
    121,
    (704, 1280),
    2,
)

TINY_NOTE = (
    "at tiny size with RANDOM weights (fixed seed): outputs are noise, for tests and benchmarks. Weights are "
    "generated on first use into the fv cache."
)
TINY_DEFAULTS = dict(num_frames=5, height=32, width=32, num_inference_steps=4)
# The shapes models' size (the embedded model and its students): 9 frames of 64x64, prompts padded to 16
# tokens (captions are 6; trained so), guidance 1, a 1.0M-parameter transformer and a 2-layer UMT5.
SHAPES_REQUEST = dict(num_frames=9, height=64, width=64, guidance_scale=1.0, max_sequence_length=16)
# causal: one latent frame per chunk; the window holds 3 latent frames keeping the first as a sink
CHUNKS = dict(chunk_frames=1, context_timestep=0, window_frames=3, sink_frames=1)
SHIPS_TRANSFORMER = (
    "Ships only its transformer; the VAE, text encoder, tokenizer and scheduler are its parent's files."
)


def _student(steps: int, timesteps: tuple[int, ...]) -> Row:
    """``wan2.1-t2v-shapes-<steps>step``: the shapes model distilled by DMD2 (fv-train-dmd2)."""
    plural = "s" if steps > 1 else ""
    return Row(
        f"wan2.1-t2v-shapes-{steps}step",
        f"The shapes model (wan2.1-t2v-shapes) distilled by DMD2 into a {steps}-step student: fixed "
        f"timesteps {list(timesteps)}, sampler 'dmd', no CFG. {SHIPS_TRANSFORMER} Trained with `fv train "
        f"configs/shapes/dmd2_{steps}step.yaml` (fv-train-dmd2); quality in bench/results/dmd2_shapes.json.",
        SHAPES,
        SHAPES_REQUEST,
        weights=f"fv_wan.cards:shapes_{steps}step_weights",
        timesteps=timesteps,
        recipe=dict(
            method="dmd2",
            parents=["wan2.1-t2v-shapes"],
            consistency_required="C2",  # its train forward is the serve forward (fv-train-dmd2's C2 gate)
            description=f"DMD2-distilled from wan2.1-t2v-shapes (30 UniPC steps, guidance 1) for {steps} "
            f"step{plural} at timesteps {list(timesteps)}, no CFG (configs/shapes/dmd2_{steps}step.yaml)",
        ),
        interceptors=frozenset(),  # one or two distilled steps: nothing to skip or reuse
    )


TABLE = (
    Row(
        "wan2.1-t2v-tiny",
        "Wan2.1 T2V architecture at tiny size with RANDOM weights (fixed seed): outputs are noise, "
        "for tests, demos and benchmarks. Weights are generated on first use into the fv cache.",
        TINY,
        TINY_DEFAULTS,
        weights="fv_wan.tiny:tiny_weights",
    ),
    Row(
        "wan2.1-t2v-shapes",
        "Wan2.1 T2V architecture at tiny size, TRAINED (the embedded default that shows what you ask for): "
        "9 frames at 64x64 of one circle or square in red, orange, yellow, green, blue or purple moving "
        "left, right, up or down on a dark background; prompt e.g. 'a red circle moving left'. Made by "
        "fv-train-flow on synthetic clips (fv_train_flow.shapes): `fv train configs/shapes/vae.yaml` "
        "(AutoencoderKLWan, 2x2 patchify, 1.5M parameters), then `fv train configs/shapes/flow.yaml` (a "
        "1.0M-parameter WanTransformer3DModel and an 83k-parameter UMT5 trained jointly by flow matching; "
        "EMA weights; prompts padded to 16 tokens). Six colour/shape/direction combinations were held out "
        "of training. Quality at the defaults (30 UniPC steps, guidance 1) in "
        "bench/results/train_shapes.json and the README.",
        SHAPES,
        dict(SHAPES_REQUEST, num_inference_steps=30),
        weights="fv_wan.cards:shapes_weights",
    ),
    _student(1, (1000,)),
    _student(2, (1000, 750)),
    Row(
        "wan2.1-t2v-shapes-nft",
        "The shapes model (wan2.1-t2v-shapes) after 90 steps of DiffusionNFT reinforcement with fv's "
        "shape/colour/direction detector as the reward (`fv train configs/shapes/nft.yaml`, fv-train-nft). "
        f"{SHIPS_TRANSFORMER} Quality against its parent (its targets are not met) in "
        "bench/results/nft_shapes.json and the README.",
        SHAPES,
        dict(SHAPES_REQUEST, num_inference_steps=30),
        weights="fv_wan.cards:shapes_nft_weights",
        recipe=dict(
            method="diffusion_nft",
            parents=["wan2.1-t2v-shapes"],
            consistency_required="C2",  # C2-free: its train forward is the serve forward (fv-train-nft)
            description="DiffusionNFT from wan2.1-t2v-shapes, 90 steps: old-policy rollouts (10 UniPC steps, "
            "no CFG) on the 42 training combinations scored by fv-train-flow's shapes-detector reward "
            "(configs/shapes/nft.yaml)",
        ),
    ),
    Row(
        "wan2.1-t2v-1.3b",
        "Wan2.1 text-to-video 1.3B (Wan-AI/Wan2.1-T2V-1.3B-Diffusers layout, fetched by its Hugging Face id).",
        WAN_1_3B,
        repo="Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
    ),
    Row(
        "wan2.1-t2v-14b",
        "Wan2.1 text-to-video 14B (Wan-AI/Wan2.1-T2V-14B-Diffusers layout, fetched by its Hugging Face id).",
        WAN_14B,
        dict(height=720, width=1280),
        repo="Wan-AI/Wan2.1-T2V-14B-Diffusers",
    ),
    Row(
        "fastwan2.1-t2v-1.3b",
        "FastWan2.1 T2V 1.3B (FastVideo/FastWan2.1-T2V-1.3B-Diffusers layout, fetched by its Hugging Face "
        "id): 3-step DMD2 sampling, no CFG.",
        WAN_1_3B,
        timesteps=(1000, 757, 522),
        recipe=dict(
            method="dmd2",
            parents=["wan2.1-t2v-1.3b"],
            description="DMD2-distilled from Wan2.1 1.3B for 3 steps at timesteps [1000, 757, 522], no CFG",
        ),
        interceptors=frozenset({"step_skip"}),  # each of 3 steps changes the latents too much to reuse a span
        repo="FastVideo/FastWan2.1-T2V-1.3B-Diffusers",
    ),
    Row(
        "wan2.1-i2v-tiny",
        "Wan2.1 I2V architecture (CLIP image encoder, image cross-attention, first-frame latent concat) "
        + TINY_NOTE,
        TINY_VARIANT,
        dict(TINY_DEFAULTS, max_sequence_length=512),
        I2V_TASKS,
        I2V_OPTIONAL,
        weights="fv_wan.tiny:i2v_weights",
    ),
    Row(
        "wan2.2-ti2v-tiny",
        "Wan2.2 TI2V-5B architecture (48-channel x16 VAE, per-token timesteps, text or image to video) "
        + TINY_NOTE,
        replace(TINY_VARIANT, config={"vae": {"z_dim": 48, "scale_factor_spatial": 16}}),
        TINY_DEFAULTS,
        TI2V_TASKS,
        weights="fv_wan.tiny:ti2v_weights",
    ),
    Row(
        "wan2.2-t2v-a14b-tiny",
        "Wan2.2 T2V A14B architecture (high- and low-noise experts, boundary 0.875) " + TINY_NOTE,
        TINY_VARIANT,
        TINY_DEFAULTS,
        T2V_TASKS,
        A14B_OPTIONAL,
        weights="fv_wan.tiny:t2v_a14b_weights",
    ),
    Row(
        "wan2.2-i2v-a14b-tiny",
        "Wan2.2 I2V A14B architecture (two experts, boundary 0.9, first-frame latent concat, no CLIP) "
        + TINY_NOTE,
        TINY_VARIANT,
        TINY_DEFAULTS,
        I2V_TASKS,
        A14B_OPTIONAL,
        weights="fv_wan.tiny:i2v_a14b_weights",
    ),
    Row(
        "wan2.1-i2v-14b-480p",
        "Wan2.1 image-to-video 14B at 480p (Wan-AI/Wan2.1-I2V-14B-480P-Diffusers layout, "
        "fetched by its Hugging Face id; pass --image).",
        replace(WAN_14B, config=I2V_14B, max_resolution=(480, 832)),
        dict(num_inference_steps=40),
        I2V_TASKS,
        I2V_OPTIONAL,
        repo="Wan-AI/Wan2.1-I2V-14B-480P-Diffusers",
    ),
    Row(
        "wan2.1-i2v-14b-720p",
        "Wan2.1 image-to-video 14B at 720p (Wan-AI/Wan2.1-I2V-14B-720P-Diffusers layout, "
        "fetched by its Hugging Face id; pass --image).",
        replace(WAN_14B, config=I2V_14B),
        dict(num_inference_steps=40, height=720, width=1280),
        I2V_TASKS,
        I2V_OPTIONAL,
        repo="Wan-AI/Wan2.1-I2V-14B-720P-Diffusers",
    ),
    Row(
        "wan2.2-ti2v-5b",
        "Wan2.2 text/image-to-video 5B, 720p at 24 fps (Wan-AI/Wan2.2-TI2V-5B-Diffusers layout, "
        "fetched by its Hugging Face id; --image for i2v).",
        TI2V_5B,
        dict(height=704, width=1280, num_frames=121, fps=24),
        TI2V_TASKS,
        repo="Wan-AI/Wan2.2-TI2V-5B-Diffusers",
    ),
    Row(
        "wan2.2-t2v-a14b",
        "Wan2.2 text-to-video A14B: high- and low-noise 14B experts (Wan-AI/Wan2.2-T2V-A14B-Diffusers "
        "layout, fetched by its Hugging Face id).",
        WAN_14B,
        dict(height=720, width=1280, num_inference_steps=40, guidance_scale=4.0, guidance_scale_2=3.0),
        T2V_TASKS,
        A14B_OPTIONAL,
        repo="Wan-AI/Wan2.2-T2V-A14B-Diffusers",
    ),
    Row(
        "wan2.2-i2v-a14b",
        "Wan2.2 image-to-video A14B: high- and low-noise 14B experts (Wan-AI/Wan2.2-I2V-A14B-Diffusers "
        "layout, fetched by its Hugging Face id; pass --image).",
        replace(WAN_14B, config=architecture(40, 40, 128, 4096, 24, in_channels=36)),
        dict(height=720, width=1280, num_inference_steps=40, guidance_scale=3.5, guidance_scale_2=3.5),
        I2V_TASKS,
        A14B_OPTIONAL,
        repo="Wan-AI/Wan2.2-I2V-A14B-Diffusers",
    ),
    Row(
        "wan2.1-t2v-tiny-causal",
        "Causal (chunk-autoregressive) Wan2.1 T2V on the tiny RANDOM-weight checkpoint of wan2.1-t2v-tiny: "
        "block-causal attention over chunks of 1 latent frame, 4 fixed steps per chunk, a rolling KV "
        "cache of 3 frames keeping 1 sink frame; outputs are noise, for tests and demos.",
        TINY,
        dict(num_frames=9, height=32, width=32, flow_shift=5.0, **CHUNKS),
        ("t2v",),
        weights="fv_wan.tiny:tiny_weights",
        timesteps=CAUSAL_TIMESTEPS,
        kv_bytes=8 << 20,
    ),
    Row(
        "wan2.1-t2v-shapes-causal",
        "The shapes model (wan2.1-t2v-shapes) made causal by self-forcing (fv-train-self-forcing, 12750 "
        "steps in four stages: configs/shapes/self_forcing.yaml, self_forcing_stage2.yaml, "
        "self_forcing_stage3.yaml, self_forcing_stage4.yaml, whose regression onto the teacher's ODE sits "
        "beside DMD): one latent frame "
        "(4 video frames) per chunk, 4 fixed steps [1000, 750, 500, 250] per chunk under flow shift 3, no "
        "CFG, each finished chunk re-run into a rolling KV cache of 3 latent frames (frame 0 kept as a "
        f"sink). {SHIPS_TRANSFORMER} Quality at 9 and 17 frames in bench/results/self_forcing_shapes.json "
        "and the README.",
        SHAPES,
        # 9 frames (3 latent frames): the window holds the whole clip, so a 17-frame rollout rolls it
        dict(num_frames=9, height=64, width=64, max_sequence_length=16, flow_shift=3.0, **CHUNKS),
        ("t2v",),
        weights="fv_wan.cards:shapes_causal_weights",
        timesteps=CAUSAL_TIMESTEPS,
        kv_bytes=4 << 20,
        recipe=dict(
            parents=["wan2.1-t2v-shapes"],
            consistency_required="C2",  # its train forward is the causal loop's chunk body (the C2 gate)
            description="self-forcing from wan2.1-t2v-shapes (30 UniPC steps, guidance 1): the student "
            "rolls out chunk by chunk on its own KV context, DMD against the bidirectional teacher "
            "(configs/shapes/self_forcing.yaml)",
        ),
    ),
    Row(
        "wan2.1-t2v-shapes-causal-long",
        "wan2.1-t2v-shapes-causal for long sessions: its causal transformer and loop with the shapes VAE's "
        "decoder fine-tuned on 17- and 33-frame clips (configs/shapes/vae_long.yaml; encoder and latent "
        "space unchanged), so frames past the 9 the shapes models trained on decode. Ships its transformer "
        "and VAE; the text encoder, tokenizer and scheduler are the shapes model's files. Quality at 9, 17 "
        "and 33 frames and under steering in bench/results/self_forcing_shapes_long.json and the README.",
        replace(SHAPES, max_frames=129),
        dict(num_frames=33, height=64, width=64, max_sequence_length=16, flow_shift=3.0, **CHUNKS),
        ("t2v",),
        weights="fv_wan.cards:shapes_causal_long_weights",
        timesteps=CAUSAL_TIMESTEPS,
        kv_bytes=4 << 20,
        recipe=dict(
            parents=["wan2.1-t2v-shapes-causal"],
            consistency_required="C2",
            description="wan2.1-t2v-shapes-causal's transformer with the decoder of configs/shapes/vae_long.yaml",
        ),
    ),
)
ROWS = {row.id: row for row in TABLE}


def card(model_id: str) -> ModelCard:
    """The card ``model_id`` of the table; unknown ids list the available ones."""
    if model_id not in ROWS:
        raise UnknownKeyError(f"unknown model {model_id!r}. Available: {sorted(ROWS)}")
    return build(ROWS[model_id])


# each card's factory, by the name plugin.py registers it under ("fv_wan.cards:wan_tiny")
wan_tiny = partial(card, "wan2.1-t2v-tiny")
wan_shapes = partial(card, "wan2.1-t2v-shapes")
wan_shapes_1step = partial(card, "wan2.1-t2v-shapes-1step")
wan_shapes_2step = partial(card, "wan2.1-t2v-shapes-2step")
wan_shapes_nft = partial(card, "wan2.1-t2v-shapes-nft")
wan_1_3b = partial(card, "wan2.1-t2v-1.3b")
wan_14b = partial(card, "wan2.1-t2v-14b")
fastwan_1_3b = partial(card, "fastwan2.1-t2v-1.3b")
wan21_i2v_tiny = partial(card, "wan2.1-i2v-tiny")
wan22_ti2v_tiny = partial(card, "wan2.2-ti2v-tiny")
wan22_t2v_a14b_tiny = partial(card, "wan2.2-t2v-a14b-tiny")
wan22_i2v_a14b_tiny = partial(card, "wan2.2-i2v-a14b-tiny")
wan21_i2v_480p = partial(card, "wan2.1-i2v-14b-480p")
wan21_i2v_720p = partial(card, "wan2.1-i2v-14b-720p")
wan22_ti2v_5b = partial(card, "wan2.2-ti2v-5b")
wan22_t2v_a14b = partial(card, "wan2.2-t2v-a14b")
wan22_i2v_a14b = partial(card, "wan2.2-i2v-a14b")
wan_tiny_causal = partial(card, "wan2.1-t2v-tiny-causal")
wan_shapes_causal = partial(card, "wan2.1-t2v-shapes-causal")
wan_shapes_causal_long = partial(card, "wan2.1-t2v-shapes-causal-long")
CARDS = tuple(partial(card, row.id) for row in TABLE)


def causal_card(
    model_id: str,
    description: str,
    cost: StepCostModel,
    *,
    defaults: dict[str, Any],
    config: dict[str, dict] | None,
    max_frames: int | None,
    max_resolution: tuple[int, int] | None,
    kv_bytes: int,
) -> ModelCard:
    """A causal Wan card of any size (benches); ``defaults`` hold the chunking (``CausalWanParams``)."""
    size = Size(config, cost, max_frames, max_resolution, kv_capacity=64)
    return build(
        Row(model_id, description, size, defaults, ("t2v",), timesteps=CAUSAL_TIMESTEPS, kv_bytes=kv_bytes)
    )
