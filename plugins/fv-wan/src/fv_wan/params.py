"""The request parameters of Wan's loops, declared once: ``WanParams`` (text/image to video) and
``CausalWanParams`` (causal Wan's chunks and KV window).

Names follow diffusers' ``WanPipeline.__call__`` (and the server's JSON); every card sets
their defaults (``fv cards --json`` prints them); ``check`` holds the rules that depend on
the card.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fv_core import ConfigError, RecipeLoopMismatch
from fv_core.card import ModelCard
from fv_core.request import VariationParams, param_meta

MAX_GUIDANCE = 30.0


class WanParams(VariationParams):
    """One Wan generation; the card supplies every default but ``prompt``."""

    prompt: str = Field(min_length=1, max_length=10_000, description="what the video shows")
    negative_prompt: str = Field(max_length=10_000, description="what to steer away from (CFG only)")
    num_frames: int = Field(
        ge=1,
        description="frames, 4k+1 (Wan's VAE packs 4 frames a latent)",
        json_schema_extra=param_meta("max_frames", "--frames"),
    )
    height: int = Field(
        ge=16,
        description="pixels, a multiple of 16 (32 for Wan2.2 TI2V-5B)",
        json_schema_extra=param_meta("max_height"),
    )
    width: int = Field(
        ge=16,
        description="pixels, a multiple of 16 (32 for Wan2.2 TI2V-5B)",
        json_schema_extra=param_meta("max_width"),
    )
    num_inference_steps: int = Field(
        ge=1, description="denoising steps", json_schema_extra=param_meta("max_steps", "--steps")
    )
    guidance_scale: float = Field(
        ge=0.0,
        le=MAX_GUIDANCE,
        description="CFG scale; 1 turns CFG off",
        json_schema_extra=param_meta("max_guidance", "--guidance"),
    )
    guidance_scale_2: float | None = Field(
        None,
        ge=0.0,
        le=MAX_GUIDANCE,
        description="CFG scale of Wan2.2 A14B's low-noise expert (default: guidance_scale)",
        json_schema_extra=param_meta("max_guidance", "--guidance-2"),
    )
    sampler: Literal["unipc", "euler", "dmd"] = Field(description="sampler (the card's loop lists its own)")
    flow_shift: float = Field(
        ge=0.01,
        le=100.0,
        description="flow-matching sigma shift (below 0.01 the schedule collapses to no noise)",
    )
    max_sequence_length: int = Field(ge=1, le=512, description="prompt tokens (padded or truncated)")
    cfg_mode: Literal["two_forward", "batched"] = Field(description="CFG as two forwards or one batched")
    fps: int = Field(ge=1, le=240, description="frames per second of the saved video")

    def check(self, card: ModelCard, loop_id: str) -> None:
        super().check(card, loop_id)
        frames = self.num_frames
        if (frames - 1) % 4:
            raise ConfigError(
                f"num_frames={frames} must be 4k+1 (1, 5, 9, ..., 81): Wan's VAE compresses time by 4. "
                f"Fix: use {max(1, (frames - 1) // 4 * 4 + 1)}",
                param="num_frames",
            )
        scale = card.components["vae"].config.get("scale_factor_spatial", 8)
        multiple = scale * 2
        for name, value in (("height", self.height), ("width", self.width)):
            if value % multiple:
                raise ConfigError(
                    f"{name}={value} must be a multiple of {multiple} (VAE x{scale}, patch x2). "
                    f"Fix: use {max(multiple, value // multiple * multiple)}",
                    param=name,
                )
        if self.guidance_scale_2 is not None and "transformer_2" not in card.components:
            raise ConfigError(
                f"guidance_scale_2={self.guidance_scale_2}: card {card.model_id!r} has one transformer; only "
                "Wan2.2 A14B cards have a second (low-noise) expert. Fix: drop guidance_scale_2.",
                param="guidance_scale_2",
            )
        samplers = card.loops[loop_id].samplers
        if self.sampler not in samplers:
            raise RecipeLoopMismatch(
                f"card {card.model_id!r} ({card.recipe.method}) loop {loop_id!r} runs samplers {samplers}, "
                f"not {self.sampler!r}. Fix: use sampler={samplers[0]!r}",
                param="sampler",
            )


class CausalWanParams(WanParams):
    """One causal Wan generation: Wan's parameters plus the chunking and the KV window (the card
    sets every default; the chunk size and context timestep are what its weights were trained for)."""

    chunk_frames: int = Field(ge=1, le=64, description="latent frames denoised together (one chunk)")
    context_timestep: int = Field(
        ge=0, le=1000, description="timestep at which a finished chunk is re-run into the KV cache"
    )
    window_frames: int = Field(ge=1, description="latent frames the KV cache holds at most (rolling window)")
    sink_frames: int = Field(ge=0, description="first latent frames the rolling window always keeps")
    session_id: str | None = Field(
        None, max_length=64, description="continue this open session's video (its frames, cache and window)"
    )
    steer_from: str | None = Field(
        None,
        max_length=4096,
        description="steering: the prompt this request moves away from (with steer_strength)",
    )
    steer_strength: float = Field(
        1.0,
        gt=0,
        le=1,
        description="steering: the share of prompt against steer_from in the text keys/values",
    )
    recache_on_prompt_change: bool = Field(
        False,
        description="when this request continues a session under another prompt (or steering) than the "
        "session's last chunk, first recompute the window's cached keys/values from its clean latents "
        "under this request's text (a KV re-cache, LongLive), so the context drops the old prompt",
    )

    def check(self, card: ModelCard, loop_id: str) -> None:
        super().check(card, loop_id)
        if self.guidance_scale != 1.0:
            raise ConfigError(
                f"guidance_scale={self.guidance_scale}: the causal loop runs no CFG (its weights are "
                "distilled to sample without it). Fix: use guidance_scale=1.0",
                param="guidance_scale",
            )
        latent = (self.num_frames - 1) // 4 + 1
        if latent % self.chunk_frames:
            fit = max(1, latent // self.chunk_frames) * self.chunk_frames
            raise ConfigError(
                f"num_frames={self.num_frames} makes {latent} latent frames, not a multiple of "
                f"chunk_frames={self.chunk_frames}: every chunk holds chunk_frames latent frames. Fix: use "
                f"num_frames={(fit - 1) * 4 + 1}",
                param="num_frames",
            )
        if self.sink_frames + self.chunk_frames > self.window_frames:
            raise ConfigError(
                f"window_frames={self.window_frames} cannot hold sink_frames={self.sink_frames} plus a chunk of "
                f"chunk_frames={self.chunk_frames}: the window keeps the sinks and makes room for each new "
                f"chunk. Fix: use window_frames>={self.sink_frames + self.chunk_frames}",
                param="window_frames",
            )
