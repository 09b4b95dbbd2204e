"""Artifacts: typed outputs with their provenance."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fv_core.errors import ConfigError


@dataclass(slots=True)
class VideoArtifact:
    """Frames ``[F, H, W, 3]`` float32 in 0..1, and how they were made."""

    frames: np.ndarray  # [frames, height, width, 3], 0..1
    fps: int = 16  # playback rate
    provenance: dict[str, Any] = field(default_factory=dict)  # card, recipe, seed, weights hash, kernels, ...

    def save(self, path: str | Path) -> Path:
        """Write an H.264 mp4 (or a PNG for a single frame) and the provenance as JSON next to it."""
        import imageio.v2 as imageio

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        pixels = (np.clip(self.frames, 0, 1) * 255).round().astype(np.uint8)
        if path.suffix.lower() == ".png":
            if len(pixels) != 1:
                raise ConfigError(
                    f"{path} is a .png, which holds one frame; this video has {len(pixels)}. "
                    "Fix: write .mp4, or generate 1 frame."
                )
            imageio.imwrite(path, pixels[0])
        else:
            imageio.mimwrite(path, list(pixels), fps=self.fps, codec="libx264", quality=8, macro_block_size=1)
        path.with_suffix(".json").write_text(json.dumps(self.provenance, indent=2, default=str))
        return path
