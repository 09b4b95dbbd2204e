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
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fv_core.card.spec import ComponentSpec, ModelCard
from fv_core.card.validate import validate_card
from fv_core.errors import WeightsError
from fv_core.live_weights import SyncableComponents, check_tensor
from fv_core.registry import Registries, resolve_lazy

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")

__all__ = [
    "check_tensor",
    "SyncableComponents",
    "component_folder",
    "SHARED_KEY",
    "FROM_PRETRAINED_LOCK",
    "bind_card",
    "cache_dir",
    "family",
    "file_fingerprint",
    "load_component",
    "materialize",
    "model_index",
    "refuse_pickles",
    "weights_fingerprint",
]


def refuse_pickles(folder: Path) -> None:
    """Raise WeightsError when the folder holds pickle checkpoint files (pickle can run code)."""
    pickles = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise WeightsError(
            f"refusing pickle checkpoint files {pickles} in {str(folder)!r}: pickle can run arbitrary code. "
            "Fix: convert them to safetensors (save_pretrained(..., safe_serialization=True)) and remove them."
        )


# diffusers' and transformers' from_pretrained build modules under a process-wide patch (parameters on
# the meta device until the weights are read): two loads on different threads (a weight sync staging
# off the engine thread while a request loads a component) corrupt each other, so every load holds it.
FROM_PRETRAINED_LOCK = threading.RLock()

SHARED_KEY = "_fv_shared"  # model_index.json: component -> its folder, relative to the checkpoint


def component_folder(folder: Path, sub: str) -> Path:
    """Where the checkpoint ``folder`` keeps its component subfolder ``sub``: ``folder/sub``, or where
    model_index.json's ``_fv_shared`` maps it (a student shipping only its transformer maps its VAE,
    text encoder, tokenizer and scheduler to its parent's: ``{"vae": "../shapes/vae"}``)."""
    index = folder / "model_index.json"
    shared = (json.loads(index.read_text()).get(SHARED_KEY) or {}) if index.is_file() else {}
    return folder / shared.get(sub, sub)


def load_component(folder: Path, name: str, spec: ComponentSpec, dtype: torch.dtype = torch.float32) -> Any:
    """Component ``name`` of the checkpoint ``folder``: its class's ``from_pretrained`` on its subfolder
    (a scheduler is its config dict)."""
    sub = component_folder(folder, spec.subfolder or name)
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
    with FROM_PRETRAINED_LOCK:
        return cls.from_pretrained(sub, use_safetensors=True, **{dtype_arg: dtype}).eval()


def weights_fingerprint(folder: Path, name: str) -> str:
    """A short content fingerprint of one component's safetensors: each file's name, size, header and
    first MiB of tensor data (cheap at any size; changes when weights are re-saved with new values)."""
    return _fingerprint(sorted(component_folder(folder, name).glob("*.safetensors")))


def file_fingerprint(path: Path) -> str:
    """:func:`weights_fingerprint` of one safetensors file (e.g. a LoRA beside the components)."""
    return _fingerprint([path])


def _fingerprint(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for path in paths:
        with path.open("rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            h.update(f"{path.name}:{path.stat().st_size}".encode())
            h.update(f.read(header_len))
            h.update(f.read(1 << 20))
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    """Where fv keeps what it writes for reuse: ``$FV_CACHE_DIR``, else ``~/.cache/fv``."""
    return Path(os.environ.get("FV_CACHE_DIR") or Path.home() / ".cache" / "fv")


def materialize(target: Path, write: Callable[[Path], None], marker: str = "model_index.json") -> str:
    """``target`` once ``write(folder)`` has filled it: written into a staging folder beside it and
    renamed into place, so concurrent processes never see half a checkpoint. ``marker``: the file a
    complete folder holds. Returns the folder."""
    if (target / marker).is_file():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=target.parent))
    try:
        write(staging)
        try:
            staging.rename(target)
        except OSError:  # another process won the race, or target exists empty
            if not (target / marker).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return str(target)


def bind_card(registries: Registries, card: ModelCard, folder: Path) -> ModelCard:
    """``card`` checked against the folder's configs and adapted to them by its family.

    A named card refuses a folder whose configs differ from what it declares (class, layer
    count, dims, scheduler): the message names both values and the fix.
    """
    if not folder.is_dir():
        raise WeightsError(f"weights folder {str(folder)!r} does not exist. Fix: pass an existing folder.")
    checks = []  # (file, key, expected value or list of allowed ones, the folder's value)
    if card.pipeline is not None:
        checks.append(
            ("model_index.json", "_class_name", card.pipeline, model_index(folder).get("_class_name"))
        )
    for name, spec in card.components.items():
        sub = spec.subfolder or name
        file = f"{sub}/{'scheduler_config.json' if spec.kind == 'scheduler' else 'config.json'}"
        config = _read_json(component_folder(folder, sub) / file.split("/", 1)[1]) if spec.config else {}
        checks += [(file, key, want, config.get(key)) for key, want in spec.config.items()]
    wrong = [c for c in checks if not (c[3] in c[2] if isinstance(c[2], list) else c[3] == c[2])]
    if wrong:
        lines = "; ".join(
            f"expects {k}={want!r} in {file}, the folder has {k}={got!r}" for file, k, want, got in wrong
        )
        raise WeightsError(
            f"card {card.model_id!r} does not fit {str(folder)!r}: {lines}. Fix: load the folder by path "
            f"(fv_core.load({str(folder)!r}), or `fv generate --weights {folder}` without --model): its card "
            "is built from its own configs."
        )
    if card.pipeline is None or card.pipeline not in registries.pipelines:
        return card
    return validate_card(family(registries, card.pipeline, folder).bind(card, folder))


def family(registries: Registries, pipeline: Any, folder: Path) -> Any:
    """The registered reader of ``pipeline`` folders."""
    if pipeline not in registries.pipelines:
        known = sorted(str(k) for k in registries.pipelines)
        raise WeightsError(
            f"{str(folder)!r} holds a {pipeline!r} checkpoint, and no installed plugin reads that "
            f"pipeline (readable: {known}). Fix: install the model plugin for it."
        )
    return registries.pipelines.get(pipeline)


def model_index(folder: Path) -> dict[str, Any]:
    return _read_json(folder / "model_index.json")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise WeightsError(f"{str(path)!r} is missing. Fix: point at a complete checkpoint folder.") from None
    except json.JSONDecodeError as exc:
        raise WeightsError(
            f"{str(path)!r} is not valid JSON ({exc}). Fix: repair or re-download it."
        ) from None
