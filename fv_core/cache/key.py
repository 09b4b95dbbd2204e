"""Cache keys: every field that can change the cached value is in the key."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class CacheKey:
    """Identity of one cached value. Two values share a key only if they are interchangeable."""

    model: str  # model / card id
    component: str  # component that produced the value (e.g. "text_encoder")
    weights_version: str  # version of that component's weights; bumped on weight sync
    content_hash: str  # content_hash() of the inputs (prompt, tokens, image, ...)
    extra: tuple[tuple[str, Any], ...] = ()  # other output-semantic fields: precision, max_len, adapter, ...

    @classmethod
    def of(cls, model: str, component: str, weights_version: str, *content: Any, **extra: Any) -> CacheKey:
        """Build a key, hashing ``content`` and sorting ``extra`` so field order never matters."""
        return cls(model, component, weights_version, content_hash(*content), tuple(sorted(extra.items())))


def content_hash(*parts: Any) -> str:
    """sha256 of tensors (dtype, shape, bytes), strings, bytes and json-able values, in order."""
    h = hashlib.sha256()
    for part in parts:
        _update(h, part)
    return h.hexdigest()


def _update(h: Any, part: Any) -> None:
    if isinstance(part, torch.Tensor):
        # a fresh dense copy: also where torch calls an expanded size-1 dim (stride 0) contiguous
        t = torch.empty(part.shape, dtype=part.dtype).copy_(part.detach())
        h.update(f"tensor:{t.dtype}:{tuple(t.shape)}:".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(part, bytes):
        h.update(b"bytes:" + len(part).to_bytes(8, "little") + part)
    elif isinstance(part, str):
        data = part.encode()
        h.update(b"str:" + len(data).to_bytes(8, "little") + data)
    elif isinstance(part, (list, tuple)):
        h.update(f"seq:{len(part)}:".encode())
        for item in part:
            _update(h, item)
    else:
        h.update(b"json:" + json.dumps(part, sort_keys=True).encode())
