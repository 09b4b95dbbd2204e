"""The request: what a caller asks one task of a model to produce, typed and validated once."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from fv_core.request.parts import Part


@dataclass(slots=True)
class Request:
    """One unit of user intent, as ``LoadedModel.prepare`` builds it. The task is declared, never inferred."""

    request_id: str  # unique within an engine
    task: str = "generate"  # the card's program, e.g. "t2v"
    params: Any = field(default_factory=dict)  # the loop's typed Params (a plain dict for card-less loops)
    parts: tuple[Part, ...] = ()  # input parts besides the params (images, audio, ...), in order
    options: dict[str, Any] = field(default_factory=dict)  # plugin -> validated options (deploy + request)
    carry: dict[str, Any] = field(default_factory=dict)  # what a program's earlier stages hand on (latents)
    seed: int = 0  # seeds the per-request generator in LoopState (params.seed when typed)
    priority: int = 0  # higher is admitted first among waiting requests
    arrival_s: float = field(default_factory=time.monotonic)  # monotonic submit time (FIFO tie-break)
    interceptors: tuple[Any, ...] = ()  # interceptors its model's deployment enabled (stateless objects)
    adapters: tuple[Any, ...] = ()  # the LoRA adapters it runs (fv_core.adapters.AdapterUse), in order
