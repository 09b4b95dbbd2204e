"""Which Wan a checkpoint folder holds, read from its ``model_index.json`` and configs.

One loop runs every variant; what differs is data: how an image conditions the
video, whether timesteps are per token, and which expert runs each step.

- Wan2.1 T2V: one transformer, no image.
- Wan2.1 I2V: a CLIP image encoder feeds the transformer's image cross-attention, and the
  image's VAE latent (plus a 4-channel first-frame mask) is concatenated to the noise
  (transformer ``in_channels`` = 2 x VAE ``z_dim`` + 4).
- Wan2.2 TI2V-5B (``expand_timesteps``): the image's latent replaces the first latent frame
  and those tokens are held at timestep 0 (per-token timesteps); text-only works too.
- Wan2.2 A14B (``boundary_ratio``): a high-noise ``transformer`` and a low-noise
  ``transformer_2``; the step's integer timestep picks the expert.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from fv_wan.checkpoint import component_dir, listed_components, pipeline_index

HIGH_NOISE, LOW_NOISE = "transformer", "transformer_2"
Conditioning = Literal["none", "concat", "first_frame"]


@dataclass(frozen=True, slots=True)
class WanVariant:
    """The variant facts a Wan loop needs, all read from the folder."""

    conditioning: Conditioning  # how an image enters: not at all, concatenated channels, or as frame 0
    image_encoder: bool  # CLIP features into the transformer's image cross-attention (Wan2.1 I2V)
    experts: tuple[str, ...]  # transformer names, high-noise first
    boundary_ratio: float | None  # the low-noise expert runs below boundary_ratio x num_train_timesteps
    latent_channels: int  # VAE z_dim
    spatial_scale: int  # pixels per latent, per side
    temporal_scale: int  # frames per latent frame
    patch: tuple[int, int, int]  # transformer patch (frames, height, width)

    @classmethod
    def of(cls, folder: Path) -> WanVariant:
        index = pipeline_index(folder)
        dit = _config(folder, "transformer")
        vae = _config(folder, "vae")
        z_dim = int(vae.get("z_dim", 16))
        if index.get("expand_timesteps"):
            conditioning: Conditioning = "first_frame"
        elif dit.get("in_channels") == 2 * z_dim + 4:
            conditioning = "concat"
        else:
            conditioning = "none"
        boundary = index.get("boundary_ratio")
        return cls(
            conditioning=conditioning,
            image_encoder=dit.get("image_dim") is not None,
            experts=(HIGH_NOISE, LOW_NOISE) if LOW_NOISE in listed_components(folder) else (HIGH_NOISE,),
            boundary_ratio=None if boundary is None else float(boundary),
            latent_channels=z_dim,
            spatial_scale=int(vae.get("scale_factor_spatial", 8)),
            temporal_scale=int(vae.get("scale_factor_temporal", 4)),
            patch=tuple(dit.get("patch_size", (1, 2, 2))),  # type: ignore[arg-type]
        )


def _config(folder: Path, component: str) -> dict:
    return json.loads((component_dir(folder, component) / "config.json").read_text())
