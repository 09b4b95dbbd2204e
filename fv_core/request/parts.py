"""Typed request inputs besides the params: text, image, video and audio parts, in order.

A loop declares the part kinds it takes (``LoopSpec.accepts``); anything else is refused
before the request reaches it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np


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
