"""The edit pipelines' prompt side: Qwen2.5-VL over the templated instruction and its input image(s).

``VLProcessor`` does what ``Qwen2VLProcessor(text=..., images=...)`` does for the edit pipelines (the
image processor's patches, each ``<|image_pad|>`` widened to the image's merged patch count, the
tokens), from the checkpoint's ``processor/`` folder, without the video processor that transformers
cannot build where torchvision is missing. ``vl_encode_body`` runs the language model with the image
features spliced in and drops the template's leading tokens, as diffusers does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# QwenImageEditPipeline's template and how many of its leading tokens it drops (prompt_template_encode,
# prompt_template_encode_start_idx); Edit Plus writes "Picture k: <image>" per image before the prompt
SYSTEM = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a new "
    "image that meets the user's requirements while maintaining consistency with the original input where "
    "appropriate.<|im_end|>\n<|im_start|>user\n"
)
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
EDIT_TEMPLATE = SYSTEM + IMAGE + "{}<|im_end|>\n<|im_start|>assistant\n"
PLUS_TEMPLATE = SYSTEM + "{}<|im_end|>\n<|im_start|>assistant\n"
PICTURE = "Picture {}: " + IMAGE
EDIT_DROP = 64
IMAGE_PAD = "<|image_pad|>"


def edit_text(prompt: str, images: int, plus: bool) -> str:
    """The templated instruction: Edit's one image in the template, Plus's ``Picture k:`` per image."""
    if not plus:
        return EDIT_TEMPLATE.format(prompt)
    return PLUS_TEMPLATE.format("".join(PICTURE.format(k + 1) for k in range(images)) + prompt)


class VLProcessor:
    """Qwen2.5-VL's image processor and tokenizer from a ``processor/`` folder (the ``processor``
    component): ``__call__(text, images)`` gives ``input_ids`` [1, n], ``pixel_values`` [patches, dim]
    and ``image_grid_thw`` [images, 3], as Qwen2VLProcessor gives them."""

    def __init__(self, image_processor: Any, tokenizer: Any) -> None:
        self.image_processor, self.tokenizer = image_processor, tokenizer

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> VLProcessor:
        from transformers import AutoImageProcessor, AutoTokenizer

        return cls(AutoImageProcessor.from_pretrained(folder), AutoTokenizer.from_pretrained(folder))

    def __call__(self, text: str, images: list[Any]) -> dict[str, torch.Tensor]:
        vision = self.image_processor(images=images, return_tensors="pt")
        grid = vision["image_grid_thw"]
        pieces = text.split(IMAGE_PAD)
        if len(pieces) != len(images) + 1:
            raise ValueError(f"{len(pieces) - 1} image placeholders for {len(images)} images")
        merge = self.image_processor.merge_size**2
        widened = pieces[0] + "".join(
            IMAGE_PAD * (int(g.prod()) // merge) + piece for g, piece in zip(grid, pieces[1:], strict=True)
        )
        ids = self.tokenizer([widened], return_tensors="pt").input_ids
        return {"input_ids": ids, "pixel_values": vision["pixel_values"], "image_grid_thw": grid}


def vl_encode_body(text_encoder, inputs: dict[str, Any]) -> dict[str, Any]:
    """The language model's last hidden states over the templated instruction with the image features
    in place of its image tokens, without the template's first ``EDIT_DROP`` tokens: ``embeds`` [1, n, dim]
    (what diffusers' ``encode_prompt`` returns for one prompt)."""
    dev = text_encoder.device
    ids = inputs["input_ids"].to(dev)
    out = text_encoder.model(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        pixel_values=inputs["pixel_values"].to(dev, text_encoder.dtype),
        image_grid_thw=inputs["image_grid_thw"].to(dev),
        output_hidden_states=True,
    )
    return {"embeds": out.hidden_states[-1][:, EDIT_DROP:]}
