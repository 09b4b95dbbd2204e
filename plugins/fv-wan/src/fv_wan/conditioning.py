"""How an image conditions a Wan video (Wan2.1 I2V, Wan2.2 I2V A14B and TI2V-5B), as diffusers' pipelines do.

- The VAE sees the image stretched to exactly height x width (Lanczos), in -1..1; for
  ``concat`` conditioning followed by num_frames - 1 black frames, for ``first_frame`` alone.
  Its latent mode, normalised with the VAE's mean/std, is the condition.
- ``concat``: the transformer input is [noise, 4-channel first-frame mask, condition].
- ``first_frame``: the condition replaces latent frame 0 of the input, and frame 0's tokens get
  timestep 0 (per-token timesteps); the finished latents get the condition back in frame 0.
- CLIP (Wan2.1 I2V only) sees the original image through the folder's image processor.
"""

from __future__ import annotations

from typing import Any

import torch

from fv_wan.variant import WanVariant


def vae_image(pil, variant: WanVariant, height: int, width: int) -> torch.Tensor:
    """[1, 3, H, W] in -1..1: stretched to height x width, as diffusers' VideoProcessor does."""
    from diffusers.video_processor import VideoProcessor

    processor = VideoProcessor(vae_scale_factor=variant.spatial_scale)
    return processor.preprocess(pil, height=height, width=width).to(torch.float32)


def condition_video(image: torch.Tensor, variant: WanVariant, num_frames: int) -> torch.Tensor:
    """What the VAE encodes: the image as frame 0, then black frames for ``concat`` conditioning."""
    image = image.unsqueeze(2)  # [1, 3, 1, H, W]
    if variant.conditioning == "first_frame":
        return image
    black = image.new_zeros(image.shape[0], image.shape[1], num_frames - 1, *image.shape[3:])
    return torch.cat([image, black], dim=2)


def latent_stats(vae, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The VAE's latent mean and 1/std, shaped [1, z_dim, 1, 1, 1] like ``like``: a latent is normalised
    as ``(z - mean) * inv_std`` (Wan's convention, as diffusers computes it)."""
    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(shape).to(like)
    return mean, 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(like)


def encode_condition_body(vae, inputs: dict[str, Any]) -> dict[str, Any]:
    """The VAE's latent mode of the condition video, normalised."""
    z = vae.encode(inputs["video"].to(vae.dtype)).latent_dist.mode().to(torch.float32)
    mean, inv_std = latent_stats(vae, z)
    return {"latents": (z - mean) * inv_std}


def clip_body(image_encoder, inputs: dict[str, Any]) -> dict[str, Any]:
    """CLIP's penultimate hidden states (Wan2.1 I2V's image features)."""
    pixels = inputs["pixels"].to(image_encoder.device, image_encoder.dtype)
    return {"features": image_encoder(pixel_values=pixels, output_hidden_states=True).hidden_states[-2]}


def concat_condition(latents: torch.Tensor, temporal_scale: int) -> torch.Tensor:
    """[mask, latents]: the mask has ``temporal_scale`` channels, ones on latent frame 0 (the image's
    pixel frame, repeated as Wan packs it), zeros elsewhere."""
    _, _, frames, height, width = latents.shape
    mask = latents.new_zeros(latents.shape[0], temporal_scale, frames, height, width)
    mask[:, :, 0] = 1.0
    return torch.cat([mask, latents], dim=1)


def with_image_frame(latents: torch.Tensor, condition: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``first_frame``: the image's latent where the mask is 0 (frame 0), ``latents`` elsewhere."""
    return (1 - mask) * condition + mask * latents


def first_frame_mask(latents_shape: tuple[int, ...], has_image: bool) -> torch.Tensor:
    """[1, 1, F, h, w]: 0 on the frame the image holds (with an image), 1 where the model denoises."""
    mask = torch.ones(1, 1, *latents_shape[2:], dtype=torch.float32)
    if has_image:
        mask[:, :, 0] = 0
    return mask
