"""The request parameters of the edit loops (task ``edit``): ``QwenImageEditParams``.

Names follow diffusers' ``QwenImageEditPipeline.__call__``. The image comes as a part (Edit: exactly one;
Edit Plus: one or more); ``height`` and ``width`` default from it, as the pipelines do: the last image's
aspect ratio at about 1024 x 1024 pixels, each side a multiple of 32.
"""

from __future__ import annotations

import math

from pydantic import Field

from fv_core.card import ModelCard
from fv_core.request import param_meta
from fv_qwen_image.params import GuidedParams, check_size

TARGET_AREA = 1024 * 1024  # the pipelines' VAE-side (and default output) pixel count
CONDITION_AREA = 384 * 384  # Edit Plus: the pixel count of each image the VL encoder sees
MAX_IMAGES = 4  # Edit Plus: input images per request (each adds ~4096 tokens to every step)


class QwenImageEditParams(GuidedParams):
    """One edit; the card supplies every default but ``prompt`` (the image is a part)."""

    height: int | None = Field(
        ge=16,
        description="output pixels, a multiple of 16 (VAE x8, patch x2); default: from the input image",
        json_schema_extra=param_meta("max_height"),
    )
    width: int | None = Field(
        ge=16,
        description="output pixels, a multiple of 16 (VAE x8, patch x2); default: from the input image",
        json_schema_extra=param_meta("max_width"),
    )

    def check(self, card: ModelCard, loop_id: str) -> None:
        super().check(card, loop_id)
        check_size(card, self.height, self.width)


def area_size(area: int, width: int, height: int) -> tuple[int, int]:
    """(width, height) of ``area`` pixels at the aspect ratio ``width / height``, each rounded to a
    multiple of 32 (diffusers' ``calculate_dimensions``)."""
    ratio = width / height
    w = math.sqrt(area * ratio)
    return round(w / 32) * 32, round(w / ratio / 32) * 32
