"""Memory in the cost model: what a device holds, and the peak activation bytes of one body call, measured.

- ``device_memory_bytes``: the default memory budget (an engine's ``Budget.memory_bytes`` when none is
  set). Admission counts each instance's resident bytes (weights, and every cache at its byte budget)
  against it, so what is left for step peaks is the device minus resident weights and cache budgets.
- ``measure_peak``: the bytes a call allocates at its peak beyond what was live before it. On CUDA the
  allocator's own statistics (``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``). A
  CPU has no allocator statistics in torch (the profiler's memory events cost seconds to start), so there
  every tensor storage an aten op creates is tracked (a ``TorchDispatchMode``): its bytes count from the
  op that made it until the storage is freed, and the peak of that sum is the call's. Workspace an op
  frees before it returns is not seen; everything the call's ops hand each other is.

The scheduler measures a call when its batch curve has no peak yet (``CostModel.wants_peak``), so the
tracking costs one call per shape bucket (the peak per row then prices any row count); that call's
seconds, slowed by the tracking, are marked ``untimed``: they reach neither the batch curve nor the calibration.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def device_memory_bytes(device: str | torch.device) -> int:
    """Total memory of ``device``: the GPU's, else the host's RAM (its cgroup limit where lower)."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[1])
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = Path("/sys/fs/cgroup/memory.max")
    text = limit.read_text().strip() if limit.exists() else "max"
    return min(total, int(text)) if text.isdigit() else total


@dataclass(slots=True)
class Peak:
    """The measured peak of one call."""

    bytes: int = 0  # most bytes the call held at once beyond what was live before it


class _StorageTracker(TorchDispatchMode):
    """Counts the bytes of the storages aten ops create while active, until each is freed."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}  # data pointer -> bytes of storages created and not yet freed
        self.current = 0
        self.peak = 0

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # no torch._dynamo.disable wrapper: importing dynamo on first use costs seconds

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if _is_tensor(t)}
        for t in tree_leaves(out):
            if not _is_tensor(t) or t.device.type != "cpu":
                continue
            storage = t.untyped_storage()
            ptr, size = storage.data_ptr(), storage.nbytes()
            if size == 0 or ptr in given or ptr in self.live:
                continue  # a view, an in-place result or a storage already counted
            self.live[ptr] = size
            self.current += size
            self.peak = max(self.peak, self.current)
            weakref.finalize(storage, self._free, ptr)
        return out

    def _free(self, ptr: int) -> None:
        self.current -= self.live.pop(ptr, 0)


def _is_tensor(value: Any) -> bool:
    """A dense tensor (one with a storage to count)."""
    return isinstance(value, torch.Tensor) and value.layout == torch.strided


@contextmanager
def measure_peak(device: str | torch.device) -> Iterator[Peak]:
    """Measure the peak bytes the enclosed call allocates on ``device`` (see the module docstring)."""
    peak, device = Peak(), torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        yield peak
        peak.bytes = max(0, torch.cuda.max_memory_allocated(device) - before)
        return
    tracker = _StorageTracker()
    with tracker:
        yield peak
    peak.bytes = tracker.peak


def untimed(outcome: Any) -> None:
    """Mark a call's results (a StepResult or a list of them) untimed: the cost model then learns nothing
    from that call's seconds, which still count in the request's timings."""
    for result in outcome if isinstance(outcome, list) else [outcome]:
        if hasattr(result, "timed"):
            result.timed = False
