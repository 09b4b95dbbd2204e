"""One-shot generation on a loaded model: what ``fv generate`` and Python users call."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from fv_core.artifacts import VideoArtifact
from fv_core.model import LoadedModel
from fv_core.plugins import dist_version
from fv_core.runtime.engine import Engine

Progress = Callable[[int, int], None]


def generate_video(
    model: LoadedModel, params: dict[str, Any], seed: int = 0, progress: Progress | None = None
) -> VideoArtifact:
    """Run one request through the engine; ``progress(step, total)`` is called after every step."""

    def on_event(event: Any) -> None:
        if progress is not None and event.kind == "progress" and event.total:
            progress(event.step, event.total)

    loop, request, instance = model.job(params, seed)
    start = time.perf_counter()
    with torch.inference_mode():
        result = Engine(device=getattr(instance, "device", "cpu"), on_event=on_event).run_one(
            loop, request, instance
        )
    seconds = time.perf_counter() - start
    frames = result.outputs["frames"]
    frames = frames.float().cpu().numpy() if isinstance(frames, torch.Tensor) else np.asarray(frames)
    return VideoArtifact(
        frames=frames,
        fps=int(params.get("fps") or 16),
        provenance=provenance(model, request.task, params, seed, result.metrics, seconds),
    )


def provenance(
    model: LoadedModel, task: str, params: dict[str, Any], seed: int, metrics: dict[str, Any], seconds: float
) -> dict[str, Any]:
    """Card, recipe, request, seed, weights fingerprints, kernels and package versions of one generation."""
    card = model.card
    packages = ["fv-core", *([model.plugin] if model.plugin else []), "torch", "diffusers", "transformers"]
    return {
        "card": card.model_id,
        "recipe": card.recipe.model_dump(),
        "task": task,
        "seed": seed,
        "params": params,
        "weights": model.weights,
        "weights_hash": dict(getattr(model.instance, "weights_versions", {})),
        "kernels": metrics.get("kernels", card.kernels),
        "metrics": metrics,
        "seconds": round(seconds, 4),
        "versions": {name: dist_version(name) for name in packages},
    }
