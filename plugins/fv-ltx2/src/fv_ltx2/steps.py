"""What LTX-2's loops share: the step bodies (pure functions of their inputs over shared weights), the
latent layout, the schedule, the x0-space guidance and the request's noise streams."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fv_core.extend import BLOCKS_INPUT
from fv_core.loop import LoopState
from fv_core.request import NoiseDraws
from fv_ltx2.prompt_kv import install as install_prompt_kv
from fv_ltx2.transformer import forward_blocks

# ---- step bodies ----


def encode_body(text_encoder, connectors, inputs: dict[str, Any]) -> dict[str, Any]:
    """Gemma's stacked hidden states of every layer, through the connectors (rows independent)."""
    mask = inputs["mask"]
    out = text_encoder(input_ids=inputs["input_ids"], attention_mask=mask, output_hidden_states=True)
    hidden = torch.stack(out.hidden_states, dim=-1).flatten(2, 3).to(text_encoder.dtype)
    video, audio, text_mask = connectors(hidden, mask, padding_side="left")
    return {"video_text": video, "audio_text": audio, "text_mask": text_mask}


def denoise_body(transformer, statics: dict[str, Any], branch: str, inputs: dict[str, Any]) -> dict[str, Any]:
    """One transformer call: the video and audio velocities of every row. With a block hook in
    ``inputs[BLOCKS_INPUT]`` (a block interceptor is on) the blocks are driven one by one through it;
    so they are when the request's prompt keys/values come precomputed (``video_kv``, ``audio_kv``)."""
    hook = inputs.get(BLOCKS_INPUT)
    if "video_kv" in inputs:
        install_prompt_kv(transformer)
    if hook is not None or "video_kv" in inputs:
        video, audio = forward_blocks(transformer, hook, branch, inputs, statics)
        return {"video": video.float(), "audio": audio.float()}
    video, audio = transformer(**transformer_kwargs(inputs, statics))
    return {"video": video.float(), "audio": audio.float()}


def lora_denoise_body(
    transformer,
    weights: dict[str, torch.Tensor],
    statics: dict[str, Any],
    branch: str,
    inputs: dict[str, Any],
) -> dict[str, Any]:
    """:func:`denoise_body` on the transformer with ``weights`` (LoRA-merged) in place of its own for this
    call only (``torch.func.functional_call`` swaps them in and back; bodies run on the engine's one
    worker thread, so no other call sees them). The modules' forward hooks still run: a request's LoRA
    adapters (``fv_core.adapters``) add their deltas unmerged on top."""
    video, audio = torch.func.functional_call(
        transformer, weights, args=(), kwargs=transformer_kwargs(inputs, statics), strict=False
    )
    return {"video": video.float(), "audio": audio.float()}


def transformer_kwargs(inputs: dict[str, Any], statics: dict[str, Any]) -> dict[str, Any]:
    """The transformer's keyword arguments for a plan's inputs."""
    return dict(
        hidden_states=inputs["latents"],
        audio_hidden_states=inputs["audio_latents"],
        encoder_hidden_states=inputs["video_text"],
        audio_encoder_hidden_states=inputs["audio_text"],
        timestep=inputs["timestep"],
        audio_timestep=inputs.get("audio_timestep"),
        sigma=inputs.get("audio_timestep", inputs["timestep"]),
        encoder_attention_mask=inputs["text_mask"],
        audio_encoder_attention_mask=inputs["text_mask"],
        video_coords=inputs["video_coords"],
        audio_coords=inputs["audio_coords"],
        return_dict=False,
        **statics,
    )


def decode_video_body(vae, inputs: dict[str, Any]) -> dict[str, Any]:
    """Denormalize latents [B, C, F, H, W], VAE decode, frames [B, F, H, W, 3] in 0..1."""
    z = inputs["latents"].to(vae.dtype)
    shape = (1, -1, 1, 1, 1)
    z = z * vae.latents_std.view(shape).to(z) / vae.config.scaling_factor + vae.latents_mean.view(shape).to(z)
    video = vae.decode(z, inputs.get("timestep"), return_dict=False)[0]
    return {"frames": (video * 0.5 + 0.5).clamp(0, 1).permute(0, 2, 3, 4, 1).float()}


def decode_audio_body(audio_vae, vocoder, inputs: dict[str, Any]) -> dict[str, Any]:
    """Denormalize packed audio latents, unpack to [B, C, L, mel], audio VAE -> mel -> vocoder waveform."""
    z = inputs["audio_latents"]
    z = z * audio_vae.latents_std.to(z) + audio_vae.latents_mean.to(z)
    z = z.unflatten(2, (-1, inputs["latent_mel_bins"])).transpose(1, 2).to(audio_vae.dtype)
    mel = audio_vae.decode(z, return_dict=False)[0]
    return {"audio": vocoder(mel).float()}


def upsample_body(upsampler, inputs: dict[str, Any]) -> dict[str, Any]:
    """The latent upsampler on denormalized video latents [B, C, F, H, W] (2x height and width)."""
    return {"latents": upsampler(inputs["latents"].to(upsampler.dtype))}


def encode_image_body(vae, inputs: dict[str, Any]) -> dict[str, Any]:
    """The VAE's latent mode of images [B, 3, H, W] in -1..1, as one-frame videos."""
    return {"latents": vae.encode(inputs["image"].to(vae.dtype).unsqueeze(2)).latent_dist.mode()}


# ---- latents, schedule, guidance ----


def pack(latents: torch.Tensor, patch: int, patch_t: int) -> torch.Tensor:
    """[B, C, F, H, W] -> tokens [B, F/pt * H/p * W/p, C * pt * p * p]."""
    b, _, f, h, w = latents.shape
    x = latents.reshape(b, -1, f // patch_t, patch_t, h // patch, patch, w // patch, patch)
    return x.permute(0, 2, 4, 6, 1, 3, 5, 7).flatten(4, 7).flatten(1, 3)


def unpack(tokens: torch.Tensor, f: int, h: int, w: int, patch: int, patch_t: int) -> torch.Tensor:
    """The inverse of :func:`pack`."""
    x = tokens.reshape(tokens.size(0), f, h, w, -1, patch_t, patch, patch)
    return x.permute(0, 4, 1, 5, 2, 6, 3, 7).flatten(6, 7).flatten(4, 5).flatten(2, 3)


def schedule(config: dict[str, Any], video_tokens: int, steps: int, sigmas: list[float] | None):
    """(timesteps, sigmas + the final 0) of LTX-2's scheduler for this many video tokens."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift

    scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)  # computes the schedule; not stepped
    mu = calculate_shift(
        video_tokens,
        config.get("base_image_seq_len", 1024),
        config.get("max_image_seq_len", 4096),
        config.get("base_shift", 0.95),
        config.get("max_shift", 2.05),
    )
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps) if sigmas is None else sigmas, mu=mu)
    return scheduler.timesteps, scheduler.sigmas


def rescale(guided: torch.Tensor, cond: torch.Tensor, factor: float) -> torch.Tensor:
    """Guidance rescale: match the guided prediction's std to the conditional one's, mixed by ``factor``."""
    dims = list(range(1, cond.ndim))
    rescaled = guided * (cond.std(dim=dims, keepdim=True) / guided.std(dim=dims, keepdim=True))
    return factor * rescaled + (1 - factor) * guided


def guided_x0(
    sample: torch.Tensor,
    sigma: torch.Tensor,
    outputs: dict[str, torch.Tensor],
    scales: list[float],
) -> torch.Tensor:
    """One modality's guided x0 (x0 = sample - v·sigma) from its branch velocities ``outputs`` (branch ->
    velocity; ``cfg`` rows [uncond, cond]) and its (guidance, stg, modality, rescale) ``scales``."""
    gs, stg, mod, factor = scales
    if "cfg" in outputs:
        uncond, cond = outputs["cfg"].chunk(2)
        x0 = sample - cond * sigma
        guided = x0 + (gs - 1) * (x0 - (sample - uncond * sigma))
    else:
        x0 = guided = sample - outputs["cond"] * sigma
    if "stg" in outputs:
        guided = guided + stg * (x0 - (sample - outputs["stg"] * sigma))
    if "modality" in outputs:
        guided = guided + (mod - 1) * (x0 - (sample - outputs["modality"] * sigma))
    return rescale(guided, x0, factor) if factor > 0 else guided


# ---- noise ----


def noise_draws(state: LoopState, request) -> NoiseDraws:
    """The request's noise draws. A program's later stage continues the streams its first stage left
    (``carry["rng"]``), as the one generator handed through diffusers' chained pipelines does."""
    draws = NoiseDraws(state.generator, request.params)
    rng = request.carry.get("rng")
    return draws if rng is None else draws.restore(rng)
