"""Typed request inputs besides the params: text, image, video and audio parts, in order.

A loop declares the part kinds it takes (``LoopSpec.accepts``); anything else is refused
before the request reaches it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from fv_core.artifacts import to_uint8


@dataclass(frozen=True, slots=True)
class TextPart:
    """A piece of text (a chat turn, a caption to edit)."""

    kind: ClassVar[str] = "text"
    text: str


@dataclass(frozen=True, slots=True)
class ImagePart:
    """An image ``[H, W, 3]`` float32 in 0..1."""

    kind: ClassVar[str] = "image"
    image: np.ndarray

    def pixels(self) -> np.ndarray:
        """The image as 8-bit RGB ``[H, W, 3]`` (what a user hands diffusers as a PIL image)."""
        return to_uint8(self.image)


@dataclass(frozen=True, slots=True)
class VideoPart:
    """A clip ``[F, H, W, 3]`` float32 in 0..1."""

    kind: ClassVar[str] = "video"
    frames: np.ndarray
    fps: int = 16


@dataclass(frozen=True, slots=True)
class AudioPart:
    """A waveform ``[samples]`` or ``[channels, samples]`` float32 in -1..1."""

    kind: ClassVar[str] = "audio"
    samples: np.ndarray
    sample_rate: int


Part = TextPart | ImagePart | VideoPart | AudioPart


MIN_IMAGE_SIDE, MAX_IMAGE_SIDE = 16, 8192  # pixels per side an input image may have


def image_part(image: object) -> ImagePart:
    """An ImagePart from what users hold: a PIL image, a file path, encoded bytes (PNG, JPEG, ...), or an
    array ``[H, W, 3]`` / grey ``[H, W]`` (uint8, or float in 0..1). Any PIL mode becomes RGB (alpha is
    dropped). Raises ConfigError naming the value, the rule and the fix."""
    import io
    from pathlib import Path

    from PIL import Image, UnidentifiedImageError

    from fv_core.errors import ConfigError

    if isinstance(image, ImagePart):
        return image
    if isinstance(image, str | Path | bytes):
        what = f"image {str(image)!r}" if not isinstance(image, bytes) else f"image ({len(image)} bytes)"
        try:
            with Image.open(io.BytesIO(image) if isinstance(image, bytes) else image) as opened:
                return image_part(opened)
        except (OSError, UnidentifiedImageError, Image.DecompressionBombError) as exc:
            raise ConfigError(
                f"{what} is not a readable image ({exc}). Fix: pass a PNG, JPEG or WebP file.", param="image"
            ) from None
    if isinstance(image, Image.Image):
        array = np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0
    elif isinstance(image, np.ndarray):
        array = _image_array(image)
    else:
        raise ConfigError(
            f"image of type {type(image).__name__} is not an image. Fix: pass a PIL image, a file path, "
            "encoded bytes or an [H, W, 3] array.",
            param="image",
        )
    height, width = array.shape[:2]
    if min(height, width) < MIN_IMAGE_SIDE or max(height, width) > MAX_IMAGE_SIDE:
        raise ConfigError(
            f"image of {width}x{height} pixels: each side must be {MIN_IMAGE_SIDE} to {MAX_IMAGE_SIDE} pixels. "
            "Fix: resize it (the model resizes to the video's size itself).",
            param="image",
        )
    return ImagePart(np.ascontiguousarray(array))


def _image_array(array: np.ndarray) -> np.ndarray:
    from fv_core.errors import ConfigError

    if array.ndim == 2:
        array = array[..., None]
    if array.ndim != 3 or array.shape[2] not in (1, 3):
        raise ConfigError(
            f"image array of shape {array.shape}: an image array is [H, W, 3] (RGB) or [H, W] (grey). "
            "Fix: drop the alpha channel or convert it to RGB.",
            param="image",
        )
    if array.dtype == np.uint8:
        array = array.astype(np.float32) / 255.0
    elif np.issubdtype(array.dtype, np.floating):
        if not np.isfinite(array).all() or array.min() < 0 or array.max() > 1:
            raise ConfigError(
                f"image array of {array.dtype} spans {array.min()}..{array.max()}: float images are in 0..1. "
                "Fix: divide by 255, or pass uint8.",
                param="image",
            )
        array = array.astype(np.float32)
    else:
        raise ConfigError(
            f"image array of dtype {array.dtype}: images are uint8 or float in 0..1. Fix: convert it.",
            param="image",
        )
    return np.repeat(array, 3, axis=2) if array.shape[2] == 1 else array
