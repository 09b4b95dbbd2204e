"""Input images as BAGEL's inferencer prepares them: every image in context is resized by the VAE-side
transform (BAGEL-7B-MoT: 1024, 512, 16), then by the ViT's (980, 224, 14); an edit's output size is the
first. Checked against an independent computation written from the official code
(``data/transforms.py``: ``MaxLongEdgeMinShortEdgeResize``, ``ImageTransform``; ``inferencer.py``:
``vae_transform.resize_transform`` then ``vit_transform``), on images outside the bounds."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from fv_bagel.images import understood
from fv_core import ConfigError
from fv_core.request import ImagePart

PUBLISHED = {"vae_transform": (1024, 512, 16), "vit_transform": (980, 224, 14)}


def official_resize(image: Image.Image, max_size: int, min_size: int, stride: int) -> Image.Image:
    """BAGEL's MaxLongEdgeMinShortEdgeResize.forward with ImageTransform's default max_pixels, on a PIL
    image (torchvision's resize of a PIL image is PIL's bicubic resize)."""
    max_pixels = 14 * 14 * 9 * 1024

    def make_divisible(value, stride):
        return max(stride, int(round(value / stride) * stride))

    def apply_scale(width, height, scale):
        return make_divisible(round(width * scale), stride), make_divisible(round(height * scale), stride)

    width, height = image.size
    scale = min(max_size / max(width, height), 1.0)
    scale = max(scale, min_size / min(width, height))
    new_width, new_height = apply_scale(width, height, scale)
    if new_width * new_height > max_pixels:
        new_width, new_height = apply_scale(new_width, new_height, max_pixels / (new_width * new_height))
    if max(new_width, new_height) > max_size:
        new_width, new_height = apply_scale(new_width, new_height, max_size / max(new_width, new_height))
    return image.resize((new_width, new_height), Image.Resampling.BICUBIC)


def official_vit_patches(image: Image.Image, patch: int) -> torch.Tensor:
    """ImageTransform's ToTensor + Normalize(0.5, 0.5), then BAGEL's patchify."""
    x = (
        torch.from_numpy(np.asarray(image, dtype=np.uint8).copy()).permute(2, 0, 1).float() / 255 - 0.5
    ) / 0.5
    c, h, w = x.shape
    x = x.reshape(c, h // patch, patch, w // patch, patch)
    return torch.einsum("chpwq->hwpqc", x).reshape(-1, patch**2 * c)


def picture(height: int, width: int) -> np.ndarray:
    return np.random.default_rng(height * width).random((height, width, 3)).astype(np.float32)


def as_pil(image: np.ndarray) -> Image.Image:
    return Image.fromarray((np.clip(image, 0, 1) * 255).round().astype(np.uint8))


def expected(image: np.ndarray, vae: tuple, vit: tuple) -> torch.Tensor:
    """The official understanding path: vae_transform's resize, then vit_transform, as patches."""
    return official_vit_patches(official_resize(official_resize(as_pil(image), *vae), *vit), vit[2])


@pytest.mark.parametrize("size", [(700, 1500), (60, 100), (800, 600)])
def test_understanding_resizes_as_the_official_inferencer_at_bagel_7b_bounds(size):
    """BAGEL-7B-MoT's bounds (its tower: patch 14, a 70-patch table) on images above, below and inside."""
    net = SimpleNamespace(vit_model=SimpleNamespace(config=SimpleNamespace(patch_size=14)), vit_side=70)
    inst = SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32)
    image = picture(*size)
    patches, ids = understood(inst, net, image, SimpleNamespace(**PUBLISHED))
    want = expected(image, PUBLISHED["vae_transform"], PUBLISHED["vit_transform"])
    assert patches.shape == want.shape and torch.equal(patches, want)
    assert len(ids) == len(want)
    if size == (60, 100):  # the ViT transform alone gives another size: the gap this closes
        alone = official_vit_patches(official_resize(as_pil(image), *PUBLISHED["vit_transform"]), 14)
        assert alone.shape[0] != want.shape[0]


def test_the_chat_loop_prefills_the_two_step_resize_with_the_cards_bounds(bagel):
    image = picture(700, 1500)
    request = bagel.prepare(
        {"prompt": "what is this?", "max_tokens": 1}, task="chat", parts=[ImagePart(image)]
    )
    assert (request.params.vae_transform, request.params.vit_transform) == ((128, 64, 16), (32, 16, 4))
    loop = bagel.loop("chat")
    state = loop.init(request)
    try:
        want = expected(image, (128, 64, 16), (32, 16, 4))
        assert torch.equal(state.tensors["image0.patches"], want)
    finally:
        loop.release(state)


def test_the_edit_size_follows_the_vae_transform_param(bagel):
    """The edit's output is the image after the VAE-side transform: the card's bounds or the request's."""
    part = ImagePart(picture(40, 56))
    edit = dict(task="edit", parts=[part], prompt="make it red", num_inference_steps=2)
    assert bagel.generate(**edit).image.shape == (64, 96, 3)  # the tiny's (128, 64, 16)
    assert bagel.generate(**edit, vae_transform=(96, 48, 16)).image.shape == (48, 64, 3)
    with pytest.raises(ConfigError, match=r"vae_transform=\[128, 64, 8\].*stride 16.*Fix"):
        bagel.generate(**edit, vae_transform=(128, 64, 8))
    with pytest.raises(ConfigError, match=r"vit_transform=\[64, 16, 4\].*at most 32 px.*Fix"):
        bagel.generate(task="chat", parts=[part], prompt="hi", max_tokens=1, vit_transform=(64, 16, 4))
    with pytest.raises(ConfigError, match="min side <= max side"):
        bagel.prepare({"prompt": "x", "vit_transform": (16, 32, 4)}, task="chat")
