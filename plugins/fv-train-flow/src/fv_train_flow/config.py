"""Options of the ``flow`` and ``vae`` methods (a config's ``options:`` section; the rest of the
config is the core's ``fv_core.training.TrainConfig``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from fv_core.training import StrictModel
from fv_train_flow.shapes import COLOURS

# Patchify 2x2 and two downsamples: x8 space, x4 time with every conv at <= 32x32 (cheap on CPU).
DEFAULT_VAE = dict(
    base_dim=24,
    z_dim=16,
    dim_mult=[1, 2, 2],
    num_res_blocks=1,
    temperal_downsample=[True, True],
    patch_size=2,
    in_channels=12,
    out_channels=12,
)


class VaeOptions(StrictModel):
    """Options of the ``vae`` method."""

    vae: dict[str, Any] = DEFAULT_VAE  # AutoencoderKLWan config (z_dim must be 16 for Wan's transformer)
    init: Path | None = None  # start from this trained vae/ folder instead of a fresh ``vae`` config
    train_encoder: bool = (
        True  # False: decoder-only finetuning; latents (and a transformer on them) stay valid
    )
    # clip lengths (4k+1 frames), one per step in turn; past 9 frames clips turn at random (render_long)
    clip_frames: list[int] = Field([9], min_length=1)
    kl_weight: float = Field(1e-6, ge=0)
    bf16: bool = False  # run the training forward under bfloat16 autocast (weights and optimiser stay fp32)
    foreground_weight: float = Field(4.0, ge=0)  # extra loss weight on object pixels
    eval_clips: int = Field(32, gt=0)  # clips of all combinations (held-out ones included) per eval
    stats_clips: int = Field(256, gt=0)  # clips used to measure latents_mean / latents_std

    @model_validator(mode="after")
    def _clip_lengths(self) -> VaeOptions:
        bad = [f for f in self.clip_frames if f < 9 or f % 4 != 1]
        if bad:
            raise ValueError(
                f"clip_frames={self.clip_frames}: {bad} are not 4k+1 frames of at least 9 (Wan's VAE makes "
                "one latent frame of the first frame and one of every 4 after it). Fix: e.g. [17, 33]"
            )
        if max(self.clip_frames) > 9 and self.train_encoder:
            raise ValueError(
                f"clip_frames={self.clip_frames} with train_encoder=true: long clips train the decoder on "
                "the frozen encoder's stationary latents (vae.stationary_latents). Fix: train_encoder: false"
            )
        return self


# The shapes model: ~1.2M-parameter Wan transformer, a 2-layer UMT5 (text_dim = d_model).
DEFAULT_TRANSFORMER = dict(
    patch_size=[1, 2, 2],
    num_attention_heads=4,
    attention_head_dim=32,
    in_channels=16,
    out_channels=16,
    text_dim=64,
    freq_dim=256,
    ffn_dim=256,
    num_layers=4,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    rope_max_seq_len=1024,
)
DEFAULT_TEXT_ENCODER = dict(
    d_model=64,
    d_kv=16,
    d_ff=128,
    num_layers=2,
    num_heads=4,
    relative_attention_num_buckets=8,
    dropout_rate=0.0,
)


# the attention projections (self and cross) and FFN linears of every Wan block
LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2")


class FlowOptions(StrictModel):
    """Options of the ``flow`` method (plain flow-matching training / finetuning of a Wan checkpoint)."""

    vae: Path | None = (
        None  # a trained diffusers vae/ folder (from the ``vae`` method) for a fresh init, frozen
    )
    init_weights: Path | None = None  # finetune this checkpoint (diffusers layout; its own vae/) instead
    transformer: dict[str, Any] = DEFAULT_TRANSFORMER  # WanTransformer3DModel config for a fresh init
    text_encoder: dict[str, Any] = DEFAULT_TEXT_ENCODER  # UMT5 config for a fresh init
    train_text_encoder: bool = True  # jointly train UMT5, else keep it frozen
    # 0: encode every batch's clips with the VAE (an unlimited stream). N: encode the stream's first N
    # clips once (cached in output_dir) and draw each batch from them; the VAE encode dominates a step.
    latent_pool: int = Field(0, ge=0)
    shift: float = Field(3.0, gt=0)  # timestep shift sigma' = s*sigma / (1 + (s-1)*sigma), as the sampler
    timestep_sampling: Literal["uniform", "logit_normal"] = "logit_normal"
    caption_dropout: float = Field(0.1, ge=0, lt=1)  # empty-prompt rate, so CFG has an unconditional branch
    ema_decay: float = Field(0.999, ge=0, lt=1)
    ema_start: int = Field(100, ge=0)  # steps before the EMA starts tracking (it copies the student then)
    max_sequence_length: int = Field(512, gt=0)  # as the serve loop pads prompts
    eval_clips: int = Field(32, gt=0)  # held-out-combination clips for the validation loss
    eval_samples: int = Field(12, ge=0)  # prompts sampled with the serve loop per eval (0: skip)
    eval_steps: int = Field(8, gt=0)  # sampling steps for those
    eval_card: str = "wan2.1-t2v-tiny"  # a Wan card whose loop serves these weights during evals
    # LoRA instead of a full fine-tune: pairs of this rank on the transformer's linears whose paths end in
    # one of lora_targets, trained through the adapter plane's hooks (base and text encoder frozen);
    # the export is diffusers' pytorch_lora_weights.safetensors, served per request with adapters
    lora_rank: int | None = Field(None, gt=0)
    lora_alpha: float | None = Field(None, gt=0)  # scale alpha / rank (default: alpha = rank)
    # module path suffixes (None: LORA_TARGETS; None also keeps older runs' recorded options resumable)
    lora_targets: list[str] | None = Field(None, min_length=1)
    # draw these colours' clips in other RGB values, captions unchanged (what a style LoRA learns, e.g.
    # {red: [0.1, 0.8, 0.2]}: "red" prompts make green objects; the VAE must reproduce the colour)
    recolour: dict[str, tuple[float, float, float]] = {}

    @model_validator(mode="after")
    def _lora_freezes_text(self) -> FlowOptions:
        unknown = sorted(set(self.recolour) - set(COLOURS))
        if unknown or any(not 0 <= c <= 1 for rgb in self.recolour.values() for c in rgb):
            raise ValueError(
                f"recolour={self.recolour} must map colours of {list(COLOURS)} to RGB values in 0..1 "
                f"(unknown: {unknown}). Fix: e.g. {{red: [0.1, 0.8, 0.2]}}"
            )
        if self.lora_rank and self.train_text_encoder and "train_text_encoder" in self.model_fields_set:
            raise ValueError(
                f"train_text_encoder=true with lora_rank={self.lora_rank}: a LoRA run trains the transformer's "
                "pairs only and keeps the text encoder frozen. Fix: drop train_text_encoder, or lora_rank"
            )
        return self
