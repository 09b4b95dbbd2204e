"""The request parameters of LTX-2's joint audio+video loop, declared once.

Names follow diffusers' ``LTX2Pipeline.__call__`` (fv's ``fps`` is its ``frame_rate``); every card
sets the defaults. The audio scales fall back to the video ones when unset or zero, as diffusers'
``audio_guidance_scale or guidance_scale`` does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pydantic import Field

from fv_core import ConfigError
from fv_core.card import ModelCard
from fv_core.request import VariationParams, param_meta

REGISTERS = 128  # the text connectors' learnable registers: text lengths are multiples of this
SIZE_MULTIPLE = 32  # diffusers' LTX2Pipeline refuses other heights and widths, whatever the VAE
AUDIO_DOWNSAMPLE = 4  # diffusers' AutoencoderKLLTX2Audio compresses time 4x (a class constant, not config)


@dataclass(frozen=True)
class Geometry:
    """What a card's folder makes of a request's size and length: the video VAE's compression and the
    audio VAE's sampling, as its card states them (:func:`fv_ltx2.folder.architecture`; LTX-2's published
    values when it states none), read where diffusers' LTX2Pipeline reads them."""

    time: int  # frames per latent frame: a video has time·k + 1 frames
    space: int  # pixels per latent row and column
    audio_per_second: float  # audio latents per second: sample rate / mel hop / AUDIO_DOWNSAMPLE

    @classmethod
    def of(cls, card: ModelCard) -> Geometry:
        vae, audio = card.components["vae"].config, card.components["audio_vae"].config
        rate, hop = audio.get("sample_rate", 16000), audio.get("mel_hop_length", 160)
        return cls(
            vae.get("temporal_compression_ratio", 8),
            vae.get("spatial_compression_ratio", 32),
            rate / hop / AUDIO_DOWNSAMPLE,
        )

    @property
    def size_multiple(self) -> int:
        """Heights and widths must be multiples of this: diffusers' check and the VAE's compression."""
        return math.lcm(SIZE_MULTIPLE, self.space)


class LTX2Params(VariationParams):
    """One LTX-2 generation (video and its soundtrack); the card supplies every default but ``prompt``."""

    prompt: str = Field(min_length=1, max_length=10_000, description="what the video shows and sounds like")
    negative_prompt: str = Field(max_length=10_000, description="what to steer away from (CFG only)")
    num_frames: int = Field(
        ge=1,
        description="frames, k × the VAE's temporal compression + 1 (8k+1 for LTX-2)",
        json_schema_extra=param_meta("max_frames", "--frames"),
    )
    height: int = Field(
        ge=32,
        description="pixels, a multiple of 32 (and of the VAE's compression)",
        json_schema_extra=param_meta("max_height"),
    )
    width: int = Field(
        ge=32,
        description="pixels, a multiple of 32 (and of the VAE's compression)",
        json_schema_extra=param_meta("max_width"),
    )
    fps: float = Field(gt=0, le=240, description="frame rate of the video (and the audio's length)")
    num_inference_steps: int = Field(
        ge=1, description="denoising steps", json_schema_extra=param_meta("max_steps", "--steps")
    )
    sigmas: list[float] | None = Field(description="float sigmas, one per step (distilled / refine stages)")
    guidance_scale: float = Field(
        ge=0,
        le=30,
        description="video CFG scale; 1 turns it off",
        json_schema_extra=param_meta("max_guidance", "--guidance"),
    )
    stg_scale: float = Field(ge=0, le=30, description="video spatio-temporal guidance scale; 0 turns it off")
    modality_scale: float = Field(ge=0, le=30, description="video modality-isolation scale; 1 turns it off")
    guidance_rescale: float = Field(ge=0, le=1, description="video guidance rescale")
    audio_guidance_scale: float | None = Field(
        ge=0, le=30, description="audio CFG scale (unset: the video's)"
    )
    audio_stg_scale: float | None = Field(ge=0, le=30, description="audio STG scale (unset: the video's)")
    audio_modality_scale: float | None = Field(
        ge=0, le=30, description="audio modality scale (unset: the video's)"
    )
    audio_guidance_rescale: float | None = Field(
        ge=0, le=1, description="audio guidance rescale (unset: the video's)"
    )
    spatio_temporal_guidance_blocks: list[int] = Field(description="transformer blocks STG perturbs")
    use_cross_timestep: bool = Field(
        description="cross-modal attention modulated by the other modality's sigma"
    )
    decode_timestep: float = Field(
        ge=0, le=1, description="VAE decode timestep (VAEs with timestep conditioning)"
    )
    max_sequence_length: int = Field(ge=REGISTERS, le=4096, description="prompt tokens (a multiple of 128)")

    def check(self, card: ModelCard, loop_id: str) -> None:
        super().check(card, loop_id)
        g = Geometry.of(card)
        t, size = g.time, g.size_multiple
        rules = [
            ("num_frames", (self.num_frames - 1) % t, f"must be {t}k+1 (1, {t + 1}, {2 * t + 1}, ...): the VAE packs "
             f"{t} frames a latent", max(1, (self.num_frames - 1) // t * t + 1)),
            ("height", self.height % size, f"must be a multiple of {size} (the VAE's compression)", max(size, self.height // size * size)),
            ("width", self.width % size, f"must be a multiple of {size} (the VAE's compression)", max(size, self.width // size * size)),
            ("max_sequence_length", self.max_sequence_length % REGISTERS, "must be a multiple of 128 (the text "
             "connectors' registers)", self.max_sequence_length // REGISTERS * REGISTERS),
        ]  # fmt: skip
        for name, broken, rule, fix in rules:
            if broken:
                raise ConfigError(f"{name}={getattr(self, name)} {rule}. Fix: use {fix}", param=name)
        if self.num_frames / self.fps * g.audio_per_second < 0.5:
            raise ConfigError(
                f"num_frames={self.num_frames} at fps={self.fps:g} lasts {self.num_frames / self.fps:.3f} s, too short "
                f"for one audio latent ({1000 / g.audio_per_second:.0f} ms). Fix: ask for more frames or a lower fps",
                param="num_frames",
            )
        if self.stg_on and not self.spatio_temporal_guidance_blocks:
            raise ConfigError(
                "STG is on (stg_scale or audio_stg_scale > 0) but spatio_temporal_guidance_blocks is empty. "
                "Fix: name the blocks to perturb, or set both STG scales to 0",
                param="spatio_temporal_guidance_blocks",
            )
        if self.sigmas is not None and len(self.sigmas) != self.num_inference_steps:
            raise ConfigError(
                f"sigmas has {len(self.sigmas)} values for num_inference_steps={self.num_inference_steps}. "
                f"Fix: give one sigma per step, or set num_inference_steps={len(self.sigmas)}",
                param="sigmas",
            )
        blocks = card.components["transformer"].config.get("num_layers")
        outside = [
            b for b in self.spatio_temporal_guidance_blocks if blocks is not None and not 0 <= b < blocks
        ]
        if outside and self.stg_on:
            raise ConfigError(
                f"spatio_temporal_guidance_blocks={self.spatio_temporal_guidance_blocks}: blocks {outside} do not "
                f"exist; {card.model_id!r} has blocks 0..{blocks - 1}. Fix: name blocks that exist",
                param="spatio_temporal_guidance_blocks",
            )

    # -- the scales the loop runs (audio ones fall back to the video ones, as diffusers' `or` does) --

    @property
    def audio_scales(self) -> tuple[float, float, float, float]:
        """(guidance, stg, modality, rescale) for audio."""
        return (
            self.audio_guidance_scale or self.guidance_scale,
            self.audio_stg_scale or self.stg_scale,
            self.audio_modality_scale or self.modality_scale,
            self.audio_guidance_rescale or self.guidance_rescale,
        )

    @property
    def cfg_on(self) -> bool:
        return self.guidance_scale > 1.0 or self.audio_scales[0] > 1.0

    @property
    def stg_on(self) -> bool:
        return self.stg_scale > 0.0 or self.audio_scales[1] > 0.0

    @property
    def modality_on(self) -> bool:
        return self.modality_scale > 1.0 or self.audio_scales[2] > 1.0


class LTX2TwoStageParams(LTX2Params):
    """``t2av-two-stage``: the base stage runs these params at half height and width; the refine stage
    runs ``refine_sigmas`` at the full size with guidance off."""

    refine_sigmas: list[float] = Field(
        min_length=1, max_length=50, description="the refine stage's float sigmas, each in (0, 1]"
    )
    refine_noise_scale: float | None = Field(
        ge=0, le=1, description="re-noise before refine (unset: the first refine sigma)"
    )

    def check(self, card: ModelCard, loop_id: str) -> None:
        super().check(card, loop_id)
        if not all(0 < sigma <= 1 for sigma in self.refine_sigmas):
            raise ConfigError(
                f"refine_sigmas={self.refine_sigmas}: sigmas are noise levels in (0, 1]. Fix: e.g. [0.909375, 0.725, 0.421875]",
                param="refine_sigmas",
            )
        size = Geometry.of(card).size_multiple
        for name in ("height", "width"):
            value = getattr(self, name)
            if value % (2 * size):
                raise ConfigError(
                    f"{name}={value} must be a multiple of {2 * size} for two stages (the base stage runs at half "
                    f"size, a multiple of {size}). Fix: use {max(2 * size, value // (2 * size) * 2 * size)}",
                    param=name,
                )


class LTX2ImageParams(LTX2Params):
    """``i2av``: the first frame is the request's image part."""

    image_crf: int = Field(
        ge=0, le=51, description="H.264 CRF the image is re-compressed at before encoding (0: as given)"
    )
