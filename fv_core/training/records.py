"""Save and load BehaviorRecords: safetensors + JSON, never pickle.

A saved set of records is a folder (as ``fv_core.loop.state_io`` saves a LoopState) with
``records.json`` (every field that is not a tensor) and ``tensors.safetensors`` (every tensor
once: a step-invariant input such as the text K/V, which the recorder holds as one object for
every step, is written once). In the JSON a tensor is ``{"__tensor__": name}``. Loading gives
records equal to the saved ones field for field, tensors bit for bit (``records_equal``); tensors
come back contiguous, on ``device``.

Signatures::

    save_records(path, records) -> Path                  # records: BehaviorRecords
    load_records(path, device="cpu") -> list[BehaviorRecord]
    records_equal(a, b) -> bool                          # fields equal, tensors bit for bit
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from fv_core.loop.observers import BehaviorRecord, StepRecord, same_bits

FORMAT = 1
_TENSOR = "__tensor__"
_STEP_FIELDS = [f.name for f in fields(StepRecord)]
_RECORD_FIELDS = [f.name for f in fields(BehaviorRecord) if f.name != "steps"]


def save_records(path: str | Path, records: Iterable[BehaviorRecord]) -> Path:
    """Write ``records`` into folder ``path`` (created if needed); returns the folder."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    names: dict[int, str] = {}  # id(tensor) -> saved name: one entry per tensor object
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()  # storages already written

    def encode(value: Any, where: str) -> Any:
        if isinstance(value, torch.Tensor):
            if id(value) not in names:
                names[id(value)] = name = f"t{len(names)}"
                tensors[name] = _own(value, seen)
            return {_TENSOR: names[id(value)]}
        if isinstance(value, dict):
            bad = [k for k in value if not isinstance(k, str)]
            if bad or _TENSOR in value:
                raise ValueError(
                    f"{where}: key {(bad or [_TENSOR])[0]!r} cannot be saved; record dicts need string keys "
                    f"other than {_TENSOR!r}"
                )
            return {k: encode(v, f"{where}.{k}") for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        raise ValueError(
            f"{where}: a {type(value).__name__} cannot be saved in a record; records hold tensors, "
            "str/int/float/bool/None and lists/dicts of them"
        )

    out = []
    for i, record in enumerate(records):
        if not isinstance(record, BehaviorRecord):
            raise ValueError(
                f"records[{i}] is a {type(record).__name__}, not a BehaviorRecord; a program's result "
                "holds one record per stage (a dict): save its values"
            )
        entry = {k: encode(getattr(record, k), f"records[{i}].{k}") for k in _RECORD_FIELDS}
        entry["steps"] = [
            {k: encode(getattr(step, k), f"records[{i}].steps[{j}].{k}") for k in _STEP_FIELDS}
            for j, step in enumerate(record.steps)
        ]
        out.append(entry)
    save_file(tensors, folder / "tensors.safetensors", metadata={"format": f"fv.behavior_records/{FORMAT}"})
    (folder / "records.json").write_text(json.dumps({"format": FORMAT, "records": out}, indent=1))
    return folder


def load_records(path: str | Path, device: str | torch.device = "cpu") -> list[BehaviorRecord]:
    """Read a folder written by :func:`save_records`; tensors are moved to ``device``."""
    folder = Path(path)
    meta = json.loads((folder / "records.json").read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(
            f"{folder}: records format {meta.get('format')!r} is not {FORMAT}; re-save them with this fv"
        )
    tensors = {k: v.to(device) for k, v in load_file(folder / "tensors.safetensors").items()}

    def decode(value: Any) -> Any:
        if isinstance(value, dict):
            if set(value) == {_TENSOR}:
                return tensors[value[_TENSOR]]
            return {k: decode(v) for k, v in value.items()}
        if isinstance(value, list):
            return [decode(v) for v in value]
        return value

    records = []
    for entry in meta["records"]:
        steps = [StepRecord(**{k: decode(s[k]) for k in _STEP_FIELDS}) for s in entry["steps"]]
        records.append(BehaviorRecord(**{k: decode(entry[k]) for k in _RECORD_FIELDS}, steps=steps))
    return records


def records_equal(a: BehaviorRecord, b: BehaviorRecord) -> bool:
    """Every field equal, tensors bit for bit (dtype, shape and device included)."""
    return _equal(
        [getattr(a, k) for k in _RECORD_FIELDS], [getattr(b, k) for k in _RECORD_FIELDS]
    ) and _equal(
        [[getattr(s, k) for k in _STEP_FIELDS] for s in a.steps],
        [[getattr(s, k) for k in _STEP_FIELDS] for s in b.steps],
    )


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and same_bits(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def _own(t: torch.Tensor, seen: set[int]) -> torch.Tensor:
    """``t`` on the CPU, contiguous, alone on its whole storage (safetensors refuses shared memory)."""
    t = t.detach().cpu().contiguous()
    storage = t.untyped_storage()
    if storage.nbytes() != t.numel() * t.element_size() or storage.data_ptr() in seen:
        t = t.clone()
    seen.add(t.untyped_storage().data_ptr())
    return t
