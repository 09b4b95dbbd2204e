"""CLIP score: how well a clip's frames agree with the prompt that asked for them.

``100 * max(cos(text embedding, image embedding), 0)`` (the CLIPScore of Hessel et al. as torchmetrics
scales it), averaged over up to ``max_frames`` evenly spaced frames of each clip. Text and images run
through transformers' ``CLIPModel`` and the folder's own ``CLIPProcessor``, every candidate of a call in
one batch.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from fv_core import ConfigError

DEFAULT_MODEL = "openai/clip-vit-base-patch32"


class ClipScorer:
    """``scorer(frames [B, F, H, W, 3] in 0..1, prompts) -> [B]`` in 0..100 (higher: the frames show the
    prompt better). ``model``: a CLIP folder (``config.json``, ``model.safetensors``, the processor's
    files) or a Hugging Face repo id."""

    def __init__(self, model: str = DEFAULT_MODEL, device: str = "cpu", max_frames: int = 8) -> None:
        from transformers import CLIPModel, CLIPProcessor

        if max_frames < 1:
            raise ConfigError(f"clip-score max_frames={max_frames}: must be >= 1. Fix: set 1 or more.")
        folder = Path(model)
        if folder.is_dir() and not (folder / "model.safetensors").is_file():
            raise ConfigError(
                f"clip-score model {model!r}: the folder has no model.safetensors (fv loads safetensors only). "
                "Fix: point at a CLIP folder saved with safetensors, or a Hugging Face repo id."
            )
        try:
            self.model = CLIPModel.from_pretrained(model, use_safetensors=True).to(device).eval()
            self.processor = CLIPProcessor.from_pretrained(model)
        except OSError as exc:
            raise ConfigError(
                f"clip-score model {model!r} cannot be loaded ({exc}). Fix: name a CLIP folder or a Hugging "
                "Face repo id in the local cache (or go online)."
            ) from None
        self.device, self.max_frames = device, max_frames

    @torch.inference_mode()
    def __call__(self, frames: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        if frames.ndim != 5 or frames.shape[0] != len(prompts):
            raise ConfigError(
                f"clip-score takes frames [B, F, H, W, 3] with one prompt per clip; got {tuple(frames.shape)} "
                f"and {len(prompts)} prompts. Fix: pass one prompt per clip."
            )
        picked = (
            np.linspace(0, frames.shape[1] - 1, min(self.max_frames, frames.shape[1])).round().astype(int)
        )
        clips = (frames[:, picked].clamp(0, 1) * 255).round().to(torch.uint8).cpu().numpy()
        images = [image for clip in clips for image in clip]
        inputs = self.processor(text=prompts, images=images, return_tensors="pt", padding=True)
        inputs = {k: v.to(self.device) for k, v in inputs.items()}
        text = _unit(
            self.model.get_text_features(
                input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]
            )
        )
        image = _unit(self.model.get_image_features(pixel_values=inputs["pixel_values"]))
        cos = (image.view(len(prompts), len(picked), -1) * text[:, None]).sum(-1)
        return (100 * cos.clamp(min=0)).mean(1).float().cpu()


def _unit(features: torch.Tensor | object) -> torch.Tensor:
    """L2-normalised embeddings (transformers 5 may return an output object holding them)."""
    tensor = features if isinstance(features, torch.Tensor) else features.pooler_output  # type: ignore[attr-defined]
    return tensor / tensor.norm(dim=-1, keepdim=True)
