"""Save and load a LoopState as a resume point: safetensors + JSON, never pickle.

A saved state is a folder with ``state.json`` (plain values, step counters,
generator device) and ``tensors.safetensors`` (every tensor, including the
generator's state). Tensors nested in ``values`` or ``plugin_state`` are
replaced in the JSON by ``{"__tensor__": name}``. Tuples come back as lists.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from fv_core.loop.contracts import LoopState

FORMAT = 1
_TENSOR = "__tensor__"


def save_state(state: LoopState, path: str | Path) -> Path:
    """Write ``state`` into folder ``path`` (created if needed); returns the folder."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    meta = {
        "format": FORMAT,
        "request_id": state.request_id,
        "loop_id": state.loop_id,
        "step": state.step,
        "total_steps": state.total_steps,
        "done": state.done,
        "tensors": _encode(state.tensors, "tensors", tensors),
        "values": _encode(state.values, "values", tensors),
        "plugin_state": _encode(state.plugin_state, "plugin_state", tensors),
        "generator": None,
    }
    if state.generator is not None:
        meta["generator"] = {"device": str(state.generator.device)}
        tensors["generator"] = state.generator.get_state()
    save_file(
        {k: v.detach().contiguous().cpu().clone() for k, v in tensors.items()}, folder / "tensors.safetensors"
    )
    (folder / "state.json").write_text(json.dumps(meta, indent=1))
    return folder


def load_state(path: str | Path, device: str | torch.device = "cpu") -> LoopState:
    """Read a folder written by :func:`save_state`; tensors are moved to ``device``."""
    folder = Path(path)
    meta = json.loads((folder / "state.json").read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(
            f"{folder}: state format {meta.get('format')!r} is not {FORMAT}; re-save it with this fv"
        )
    tensors = load_file(folder / "tensors.safetensors")
    generator = None
    if meta["generator"] is not None:
        generator = torch.Generator(device=meta["generator"]["device"])
        generator.set_state(tensors.pop("generator"))
    moved = {k: v.to(device) for k, v in tensors.items()}
    return LoopState(
        request_id=meta["request_id"],
        loop_id=meta["loop_id"],
        step=meta["step"],
        total_steps=meta["total_steps"],
        generator=generator,
        tensors=_decode(meta["tensors"], moved),
        values=_decode(meta["values"], moved),
        plugin_state=_decode(meta["plugin_state"], moved),
        done=meta["done"],
    )


def _encode(obj: Any, name: str, out: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        out[name] = obj
        return {_TENSOR: name}
    if isinstance(obj, dict):
        bad = [k for k in obj if not isinstance(k, str)]
        if bad:
            raise TypeError(f"LoopState {name}: key {bad[0]!r} is not a str; use string keys in saved state")
        return {k: _encode(v, f"{name}/{k}", out) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_encode(v, f"{name}/{i}", out) for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(
        f"LoopState {name}: {type(obj).__name__} cannot be saved; keep only tensors, str/int/float/bool/None, "
        "lists and str-keyed dicts in per-request state"
    )


def _decode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {_TENSOR}:
            return tensors[obj[_TENSOR]]
        return {k: _decode(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    return obj
