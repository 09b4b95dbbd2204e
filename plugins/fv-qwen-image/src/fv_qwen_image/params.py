"""The request parameters of Qwen-Image's loop, declared once: ``QwenImageParams``.

Names follow diffusers' ``QwenImagePipeline.__call__`` (and the server's JSON); the card sets their
defaults (``fv cards --json`` prints them); ``check`` holds the rules that depend on the card.
"""

from __future__ import annotations

from pydantic import Field

from fv_core import ConfigError
from fv_core.card import ModelCard
from fv_core.request import VariationParams, param_meta

MAX_TEXT = 1024  # the pipeline's tokenizer_max_length: prompt tokens after the template's are dropped


class GuidedParams(VariationParams):
    """What every Qwen-Image task takes: the prompt, true CFG and the steps (the card's defaults)."""

    prompt: str = Field(min_length=1, max_length=10_000, description="what the image shows")
    negative_prompt: str | None = Field(
        max_length=10_000,
        description="what to steer away from; true CFG runs only with one (even ' ') and true_cfg_scale > 1",
    )
    true_cfg_scale: float = Field(
        ge=0.0,
        le=30.0,
        description="true CFG scale (two forwards, the result rescaled to the conditional norm); 1 turns it off",
        json_schema_extra=param_meta("max_guidance"),
    )
    num_inference_steps: int = Field(
        ge=1, description="denoising steps", json_schema_extra=param_meta("max_steps", "--steps")
    )


class QwenImageParams(GuidedParams):
    """One Qwen-Image generation; the card supplies every default but ``prompt``."""

    height: int = Field(
        ge=16,
        description="pixels, a multiple of 16 (VAE x8, patch x2)",
        json_schema_extra=param_meta("max_height"),
    )
    width: int = Field(
        ge=16,
        description="pixels, a multiple of 16 (VAE x8, patch x2)",
        json_schema_extra=param_meta("max_width"),
    )
    max_sequence_length: int = Field(ge=1, le=MAX_TEXT, description="prompt tokens kept after the template's")

    def check(self, card: ModelCard, loop_id: str) -> None:
        super().check(card, loop_id)
        check_size(card, self.height, self.width)


def check_size(card: ModelCard, height: int | None, width: int | None) -> None:
    """Sizes on the patch grid (a multiple of VAE scale x patch 2), or a ConfigError naming the fix."""
    multiple = vae_scale(card) * 2
    for name, value in (("height", height), ("width", width)):
        if value is not None and value % multiple:
            raise ConfigError(
                f"{name}={value} must be a multiple of {multiple} (VAE x{multiple // 2}, patch x2; diffusers "
                f"would silently shrink the image). Fix: use {max(multiple, value // multiple * multiple)}",
                param=name,
            )


def vae_scale(card: ModelCard) -> int:
    """The VAE's spatial scale: 2 ** the number of its downsamplings (8 for Qwen-Image's)."""
    return 2 ** len(card.components["vae"].config.get("temperal_downsample", [False, True, True]))


def cfg_on(params: GuidedParams) -> bool:
    """Whether true CFG runs: as diffusers, a scale above 1 and a negative prompt."""
    return params.true_cfg_scale > 1 and params.negative_prompt is not None
