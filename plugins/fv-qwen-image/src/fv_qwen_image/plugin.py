"""fv-qwen-image's pluggy hooks (entry point ``fv.plugins: fv-qwen-image``). Everything is lazy: no
torch model code is imported until a card is loaded."""

from __future__ import annotations

from fv_core.extend import hookimpl

CARDS = {
    "qwen-image-tiny": "fv_qwen_image.cards:qwen_image_tiny",
    "qwen-image": "fv_qwen_image.cards:qwen_image",
    "qwen-image-edit-tiny": "fv_qwen_image.cards:qwen_image_edit_tiny",
    "qwen-image-edit": "fv_qwen_image.cards:qwen_image_edit",
    "qwen-image-edit-plus-tiny": "fv_qwen_image.cards:qwen_image_edit_plus_tiny",
    "qwen-image-edit-plus": "fv_qwen_image.cards:qwen_image_edit_plus",
}


@hookimpl
def fv_register_cards(register) -> None:
    for model_id, factory in CARDS.items():
        register(model_id, factory)


@hookimpl
def fv_register_pipelines(register) -> None:
    for pipeline in ("QwenImagePipeline", "QwenImageEditPipeline", "QwenImageEditPlusPipeline"):
        register(pipeline, "fv_qwen_image.folder:QwenImageFolder")
