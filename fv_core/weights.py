"""Checkpoint folders in the published diffusers layout: refuse pickles, fingerprint, load a component.

A component is loaded with the class its card names (``ComponentSpec.load_id``, ``"library:Class"``)
through that library's own ``from_pretrained``, safetensors only. Model families whose folders
follow the diffusers layout use these instead of writing their own loader.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fv_core.card.spec import ComponentSpec
from fv_core.errors import WeightsError
from fv_core.registry import resolve_lazy

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


def refuse_pickles(folder: Path) -> None:
    """Raise WeightsError when the folder holds pickle checkpoint files (pickle can run code)."""
    pickles = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise WeightsError(
            f"refusing pickle checkpoint files {pickles} in {str(folder)!r}: pickle can run arbitrary code. "
            "Fix: convert them to safetensors (save_pretrained(..., safe_serialization=True)) and remove them."
        )


def load_component(folder: Path, name: str, spec: ComponentSpec, dtype: torch.dtype = torch.float32) -> Any:
    """Component ``name`` of the checkpoint ``folder``: its class's ``from_pretrained`` on its subfolder
    (a scheduler is its config dict)."""
    sub = folder / (spec.subfolder or name)
    if not sub.is_dir():
        raise WeightsError(
            f"{str(folder)!r} has no {sub.name}/ folder for component {name!r}. "
            "Fix: point at a complete checkpoint in the published diffusers layout."
        )
    if spec.kind == "scheduler":
        return json.loads((sub / "scheduler_config.json").read_text())
    cls = resolve_lazy(spec.load_id)
    if spec.kind == "tokenizer":
        return cls.from_pretrained(sub)
    refuse_pickles(sub)
    if not list(sub.glob("*.safetensors")):
        raise WeightsError(
            f"{str(sub)!r} holds no *.safetensors weights. Fix: convert the weights to safetensors."
        )
    dtype_arg = "dtype" if cls.__module__.startswith("transformers") else "torch_dtype"
    return cls.from_pretrained(sub, use_safetensors=True, **{dtype_arg: dtype}).eval()


def weights_fingerprint(folder: Path, name: str) -> str:
    """A short content fingerprint of one component's safetensors: each file's name, size, header and
    first MiB of tensor data (cheap at any size; changes when weights are re-saved with new values)."""
    h = hashlib.sha256()
    for path in sorted((folder / name).glob("*.safetensors")):
        with path.open("rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            h.update(f"{path.name}:{path.stat().st_size}".encode())
            h.update(f.read(header_len))
            h.update(f.read(1 << 20))
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    """Where fv keeps what it writes for reuse: ``$FV_CACHE_DIR``, else ``~/.cache/fv``."""
    return Path(os.environ.get("FV_CACHE_DIR") or Path.home() / ".cache" / "fv")


def materialize(target: Path, write: Callable[[Path], None]) -> str:
    """``target`` once ``write(folder)`` has filled it: written into a staging folder beside it and
    renamed into place, so concurrent processes never see half a checkpoint. Returns the folder."""
    if (target / "model_index.json").is_file():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=target.parent))
    try:
        write(staging)
        try:
            staging.rename(target)
        except OSError:  # another process won the race, or target exists empty
            if not (target / "model_index.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return str(target)
