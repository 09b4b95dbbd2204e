"""The request parameters of BAGEL's loops, declared once; the cards hold their defaults (BAGEL's
published inference settings: ``inferencer.py`` and ``app.py``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from fv_core import ConfigError
from fv_core.card import ModelCard
from fv_core.request import Params, VariationParams, param_meta

MAX_PROMPT = 20_000  # characters; the tokenized context is checked against the model's positions
# BAGEL's ImageTransform bounds (inferencer.py / app.py): (max side, min side, stride) in pixels
VAE_TRANSFORM = (1024, 512, 16)
VIT_TRANSFORM = (980, 224, 14)


class ImageInputs(Params):
    """How the request's input images are resized (BAGEL's two transforms, in this order)."""

    vae_transform: tuple[int, int, int] = Field(
        VAE_TRANSFORM, description="input images first (BAGEL's vae_transform; an edit's output size): "
        "(max side, min side, stride) in pixels",
    )  # fmt: skip
    vit_transform: tuple[int, int, int] = Field(
        VIT_TRANSFORM, description="then for the ViT's understanding tokens (BAGEL's vit_transform): "
        "(max side, min side, stride) in pixels",
    )  # fmt: skip

    @field_validator("vae_transform", "vit_transform")
    @classmethod
    def _ordered(cls, value: tuple[int, int, int]) -> tuple[int, int, int]:
        most, least, stride = value
        if not 0 < stride <= least <= most:
            raise ValueError(
                f"{list(value)} must satisfy 0 < stride <= min side <= max side. Fix: e.g. {list(VAE_TRANSFORM)}"
            )
        return value


class TextParams(ImageInputs):
    """Sampling of the AR decode loop (``chat``; the thinking of ``think-t2i``), and how its images are resized."""

    prompt: str = Field(min_length=1, max_length=MAX_PROMPT, description="the user's message")
    max_tokens: int = Field(ge=1, le=32_768, description="most new tokens to generate")
    temperature: float = Field(
        ge=0.0, le=10.0, description="sampling temperature; 0: greedy (BAGEL's default)"
    )
    top_p: float = Field(
        gt=0.0, le=1.0, description="nucleus sampling: keep the smallest set of tokens with this mass"
    )
    top_k: int = Field(ge=0, le=1_000_000, description="keep only the k most likely tokens; 0: all")
    stop: list[str] = Field(
        max_length=16, description="stop when the text contains one of these (not returned)"
    )
    think: bool = Field(
        description="reason inside <think> ... </think> first (BAGEL's thinking system prompt)"
    )
    speculative_k: int = Field(
        ge=0, le=16, description="speculative decoding: tokens drafted from the context (prompt lookup) and "
        "verified in one step, the output unchanged; 0: off",
    )  # fmt: skip
    speculative_ngram: int = Field(
        ge=1, le=8, description="speculative decoding: the longest n-gram of the context matched to draft"
    )

    @field_validator("stop")
    @classmethod
    def _stops_not_empty(cls, value: list[str]) -> list[str]:
        if any(not s for s in value):
            raise ValueError(f"stop={value!r} holds an empty string, which would stop at once. Fix: drop it")
        return value


class GuidedParams(VariationParams):
    """The denoise loop's schedule and guidance (``t2i``, ``edit``)."""

    prompt: str = Field(min_length=1, max_length=MAX_PROMPT, description="what the image shows")
    num_inference_steps: int = Field(
        ge=2, le=1000, description="timesteps of the schedule (BAGEL's num_timesteps; steps run: one fewer)",
        json_schema_extra=param_meta("max_steps", "--steps"),
    )  # fmt: skip
    cfg_text_scale: float = Field(
        ge=0.0, le=30.0, description="guidance against the text-unconditioned context"
    )
    cfg_img_scale: float = Field(
        ge=0.0, le=30.0, description="guidance against the image-unconditioned context"
    )
    cfg_interval: tuple[float, float] = Field(description="guidance runs while lo < t <= hi (t from 1 to 0)")
    cfg_renorm_type: Literal["global", "channel", "text_channel"] = Field(
        description="how guided velocity is renormed"
    )
    cfg_renorm_min: float = Field(ge=0.0, le=1.0, description="lower clamp of the renorm factor")
    timestep_shift: float = Field(gt=0.0, le=100.0, description="flow time shift of the schedule")

    def check(self, card: ModelCard, loop_id: str) -> None:
        super().check(card, loop_id)
        lo, hi = self.cfg_interval
        if not 0.0 <= lo <= hi <= 1.0:
            raise ConfigError(
                f"cfg_interval={list(self.cfg_interval)} must satisfy 0 <= lo <= hi <= 1. Fix: e.g. [0.4, 1.0]",
                param="cfg_interval",
            )


class EditParams(GuidedParams, ImageInputs):
    """``edit``: the instruction and guidance; the input image, resized as BAGEL does, sets the size."""


class ImageParams(GuidedParams):
    """One image from the denoise loop (``t2i``)."""

    height: int = Field(
        ge=16, description="pixels, a multiple of 16", json_schema_extra=param_meta("max_height")
    )
    width: int = Field(
        ge=16, description="pixels, a multiple of 16", json_schema_extra=param_meta("max_width")
    )

    def check(self, card: ModelCard, loop_id: str) -> None:
        super().check(card, loop_id)
        for name in ("height", "width"):
            value = getattr(self, name)
            if value % 16:
                raise ConfigError(
                    f"{name}={value} is not a multiple of 16 (BAGEL packs 2x2 patches of the x8 latent). "
                    f"Fix: use {max(16, value // 16 * 16)}",
                    param=name,
                )


class ThinkImageParams(ImageParams):
    """``think-t2i``: the thinking's sampling (BAGEL: greedy, up to 1024 tokens), then the image's params."""

    max_tokens: int = Field(ge=1, le=32_768, description="most tokens of thinking")
    temperature: float = Field(ge=0.0, le=10.0, description="sampling temperature of the thinking; 0: greedy")
    top_p: float = Field(gt=0.0, le=1.0, description="nucleus sampling of the thinking")
    top_k: int = Field(ge=0, le=1_000_000, description="top-k of the thinking; 0: all")
    speculative_k: int = Field(
        ge=0, le=16, description="speculative decoding of the thinking: tokens drafted per step; 0: off"
    )
    speculative_ngram: int = Field(
        ge=1, le=8, description="speculative decoding of the thinking: the longest n-gram matched to draft"
    )
