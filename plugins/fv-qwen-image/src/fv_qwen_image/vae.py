"""The VAE on single images: AutoencoderKLQwenImage's causal 3D convolutions, one frame at a time.

An image is one frame. diffusers' causal convolution pads a first frame with ``kernel_t - 1`` zero frames
in time and runs the 3D kernel over them, so two of a 3-frame kernel's three time taps multiply zeros:
for a one-frame input without cached frames its output is the 2D convolution of that frame with the
kernel's last time tap, the same numbers (to fp32 rounding: ~1e-6, the 2D kernel sums in another order)
for a third of the work. Every other call (video chunks, cached frames, strided time) runs diffusers' own
forward, and so do kernels one frame deep (nothing to save). :func:`decode_image` and :func:`encode_image`
run the decoder / encoder on the one frame without diffusers' frame cache, which only later frames read
(each convolution clones its input into it): bit for bit diffusers' decode / encode on its own modules.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers.models.autoencoders.autoencoder_kl_qwenimage import QwenImageCausalConv3d


class FrameCausalConv3d(QwenImageCausalConv3d):
    """QwenImageCausalConv3d with the one-frame shortcut (see the module docstring)."""

    def forward(self, x: torch.Tensor, cache_x: torch.Tensor | None = None) -> torch.Tensor:
        kt, st, dt = self.kernel_size[0], self.stride[0], self.dilation[0]
        if (
            x.shape[2] != 1
            or cache_x is not None
            or kt == 1
            or st != 1
            or dt != 1
            or self._padding[4] != kt - 1
        ):
            return super().forward(x, cache_x)
        pad_w, pad_h = self._padding[0], self._padding[2]
        weight = self.weight[:, :, -1]  # the only time tap that meets the frame (the others meet the padding)
        out = F.conv2d(x[:, :, 0], weight, self.bias, self.stride[1:], (pad_h, pad_w), self.dilation[1:])
        return out.unsqueeze(2)


def frame_convolutions(vae: torch.nn.Module) -> torch.nn.Module:
    """``vae`` with each causal convolution taking the one-frame shortcut (the modules keep their weights)."""
    for module in vae.modules():
        if type(module) is QwenImageCausalConv3d:
            module.__class__ = FrameCausalConv3d
    return vae


def decode_image(vae, z: torch.Tensor) -> torch.Tensor:
    """``vae.decode(z).sample`` of one latent frame ``z`` [B, C, 1, h, w] (its tiled path when tiling is on)."""
    tile = (
        vae.tile_sample_min_height // vae.spatial_compression_ratio,
        vae.tile_sample_min_width // vae.spatial_compression_ratio,
    )
    if z.shape[2] != 1 or (vae.use_tiling and (z.shape[-1] > tile[1] or z.shape[-2] > tile[0])):
        return vae.decode(z, return_dict=False)[0]
    return vae.decoder(vae.post_quant_conv(z)).clamp(-1.0, 1.0)


def encode_image(vae, x: torch.Tensor) -> torch.Tensor:
    """``vae.encode(x).latent_dist.mode()`` of one frame ``x`` [B, 3, 1, H, W] (its tiled path when tiling is on)."""
    tiled = vae.use_tiling and (
        x.shape[-1] > vae.tile_sample_min_width or x.shape[-2] > vae.tile_sample_min_height
    )
    if x.shape[2] != 1 or tiled:
        return vae.encode(x).latent_dist.mode()
    return vae.quant_conv(vae.encoder(x))[:, : vae.config.z_dim]
