"""Input images as BAGEL's inferencer prepares them (``data/transforms.py``, ``inferencer.py``).

Every image in a request's context is first resized by the VAE-side transform (BAGEL-7B-MoT: long
side at most 1024, short side at least 512, multiples of 16), then by the ViT's (980, 224, 14) for its
understanding tokens; an edited image's latent is encoded from the first. The bounds are request
params whose defaults the card holds (``vae_transform``, ``vit_transform``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from PIL import Image

from fv_bagel.mot import grid_ids
from fv_core import ConfigError

MAX_PIXELS = 14 * 14 * 9 * 1024  # ImageTransform's default cap on an image's pixels


def fit(width: int, height: int, bounds: tuple[int, int, int]) -> tuple[int, int]:
    """The size BAGEL's ``MaxLongEdgeMinShortEdgeResize`` gives a ``width x height`` image: the long side
    at most ``max``, the short side at least ``min`` (aspect kept), each side rounded to a multiple of
    ``stride``; then at most ``MAX_PIXELS`` pixels and the long side at most ``max`` again."""
    most, least, stride = bounds

    def side(value: int, scale: float) -> int:
        return max(stride, int(round(round(value * scale) / stride) * stride))

    def scaled(w: int, h: int, scale: float) -> tuple[int, int]:
        return side(w, scale), side(h, scale)

    scale = max(min(most / max(width, height), 1.0), least / min(width, height))
    w, h = scaled(width, height, scale)
    if w * h > MAX_PIXELS:
        w, h = scaled(w, h, MAX_PIXELS / (w * h))
    if max(w, h) > most:
        w, h = scaled(w, h, most / max(w, h))
    return w, h


def resize(image: Image.Image, bounds: tuple[int, int, int]) -> Image.Image:
    """``image`` resized to :func:`fit`'s size, bicubic (torchvision's resize of a PIL image)."""
    return image.resize(fit(*image.size, bounds), Image.Resampling.BICUBIC)


def to_pil(image: np.ndarray) -> Image.Image:
    """A request's image ``[H, W, 3]`` in 0..1 as the 8-bit RGB image BAGEL's transforms take."""
    return Image.fromarray((np.clip(image, 0, 1) * 255).round().astype(np.uint8))


def pixels(image: Image.Image) -> torch.Tensor:
    """``image`` as ``[H, W, 3]`` in -1..1 (ToTensor, then Normalize with mean and std 0.5)."""
    return torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0) * 2 - 1


def check_bounds(name: str, bounds: tuple[int, int, int], stride: int, most: int, what: str) -> None:
    """``bounds`` (a request's transform) must step by the model's ``stride`` and stay within ``most``."""
    if bounds[2] != stride or bounds[0] > most:
        raise ConfigError(
            f"{name}={list(bounds)} (max side, min side, stride) does not fit this model: {what} needs "
            f"stride {stride} and a max side of at most {most} px. Fix: use such bounds, or leave {name} "
            "to the card's default",
            param=name,
        )


def vit_patches(inst: Any, net: Any, image: Image.Image) -> tuple[torch.Tensor, torch.Tensor]:
    """An image already resized by the ViT transform as SigLIP NaViT patches ``[N, p*p*3]`` (row-major,
    each ``p x p x 3``) and their flattened position ids."""
    p, side = net.vit_model.config.patch_size, net.vit_side
    x = pixels(image)
    rows, cols = x.shape[0] // p, x.shape[1] // p
    patches = x.reshape(rows, p, cols, p, 3).permute(0, 2, 1, 3, 4).reshape(rows * cols, p * p * 3)
    return patches.to(inst.device, inst.dtype), grid_ids(rows, cols, side).to(inst.device)


def understood(inst: Any, net: Any, image: np.ndarray, params: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A request's image for understanding: the VAE-side resize, then the ViT's, as ViT patches."""
    return vit_patches(
        inst, net, resize(resize(to_pil(image), params.vae_transform), vit_bounds(net, params))
    )


def vit_bounds(net: Any, params: Any) -> tuple[int, int, int]:
    """The request's ViT transform, checked against the tower (its patch, its position table)."""
    p = net.vit_model.config.patch_size
    check_bounds("vit_transform", params.vit_transform, p, net.vit_side * p, "the ViT's position table")
    return params.vit_transform
