"""The Wan VAE's RMS norm, fast on a call of several videos.

diffusers' ``WanRMS_norm`` normalises with ``F.normalize`` over the channels, which torch computes as
a strided ``vector_norm``: on CPU about 10x slower than ``sqrt(sum(x^2))`` (4.4 vs 0.38 ms for 96
channels of 4 x 64 x 64), and a tenth of a batched medium-bench request's time. A VAE call of several
videos (a batch's decode) takes the fast form, equal to within float rounding; a call of one video
keeps diffusers' own, so a request alone stays bit for bit diffusers'.
"""

from __future__ import annotations

import torch
from diffusers.models.autoencoders.autoencoder_kl_wan import WanRMS_norm

EPS = 1e-12  # F.normalize's


class BatchRMSNorm(WanRMS_norm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1:
            return super().forward(x)
        y = x if x.dtype in (torch.float32, torch.float64) else x.float()  # low precision: in float32
        # clamped before the root: the same value as F.normalize's clamp after it, and no NaN gradient at 0
        norm = y.square().sum(1 if self.channel_first else -1, keepdim=True).clamp_min(EPS**2).sqrt()
        return (y / norm).to(x.dtype) * self.scale * self.gamma + self.bias


def install_batch_norms(vae: torch.nn.Module) -> None:
    """Give ``vae``'s RMS norms the batched fast form (same parameters, same state dict)."""
    for module in vae.modules():
        if type(module) is WanRMS_norm:
            module.__class__ = BatchRMSNorm
