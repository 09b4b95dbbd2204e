"""Encoding what the models make for HTTP: frames as PNG, videos saved atomically (mp4 and provenance)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from fv_core.artifacts import VideoArtifact, to_uint8


def encode_png(frame: np.ndarray) -> bytes:
    """One frame ``[H, W, 3]`` in 0..1 as PNG bytes."""
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(to_uint8(frame)).save(out, format="PNG")
    return out.getvalue()


def save_atomically(artifact: VideoArtifact, path: Path) -> None:
    """Save the artifact (and its provenance JSON) under hidden names, then move both into place."""
    tmp = artifact.save(path.with_name(f".{path.name}"))
    tmp.with_suffix(".json").replace(path.with_suffix(".json"))
    tmp.replace(path)
