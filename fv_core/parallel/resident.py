"""Step-invariant inputs cross to the workers once, not every step.

A request's text keys/values are the same tensor at every denoise step; a step names such inputs
``resident``. Rank 0 sends a resident tensor the first time with a key (:class:`Store`), then only the
key (:class:`Resident`); workers keep what they were sent. A tensor is known by its base tensor's
identity, view geometry and version, and rank 0 holds only a weak reference to the base: when the base
is freed (its request finished) the key goes into the next step's evictions, so a key never outlives
its tensor and worker memory follows rank 0's. A batch that concatenates requests' inputs makes a new
tensor each step: it is sent each step and evicted after.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class Resident:
    key: int  # a tensor the workers already hold


@dataclass(frozen=True, slots=True)
class Store:
    key: int  # keep ``tensor`` under this key
    tensor: torch.Tensor  # on the CPU while it travels


class ResidentSender:
    """Rank 0's side: which resident tensors the workers hold."""

    def __init__(self) -> None:
        self._keys: dict[tuple, int] = {}
        self._dead: list[int] = []
        self._ids = itertools.count()

    def encode(self, inputs: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
        """``inputs`` with each named tensor replaced by a Resident (held) or a Store (first time)."""
        out = dict(inputs)
        for name in names:
            tensor = inputs.get(name)
            if not isinstance(tensor, torch.Tensor):
                continue
            base = tensor._base if tensor._base is not None else tensor
            version = -1 if base.is_inference() else base._version  # inference tensors keep no version
            ident = (id(base), tensor.storage_offset(), tuple(tensor.shape), tensor.stride(), version)
            key = self._keys.get(ident)
            if key is not None:
                out[name] = Resident(key)
                continue
            key = self._keys[ident] = next(self._ids)
            weakref.finalize(base, self._forget, ident)
            out[name] = Store(key, tensor.to("cpu"))
        return out

    def _forget(self, ident: tuple) -> None:
        key = self._keys.pop(ident, None)
        if key is not None:
            self._dead.append(key)

    def evictions(self) -> list[int]:
        """Keys whose tensors rank 0 freed since the last call."""
        dead, self._dead = self._dead, []
        return dead


class ResidentStore:
    """A worker's side: the resident tensors it was sent, on its device."""

    def __init__(self) -> None:
        self.tensors: dict[int, torch.Tensor] = {}

    def decode(self, inputs: dict[str, Any], evict: list[int], device: torch.device) -> dict[str, Any]:
        for key in evict:
            self.tensors.pop(key, None)
        out = {}
        for name, value in inputs.items():
            if isinstance(value, Store):
                self.tensors[value.key] = value.tensor.to(device)
                value = self.tensors[value.key]
            elif isinstance(value, Resident):
                value = self.tensors[value.key]
            out[name] = value
        return out
