"""The request: what a caller asks one loop (or program) to produce."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Request:
    """One unit of user intent. The task is declared, never inferred."""

    request_id: str  # unique within an engine
    task: str = "generate"  # e.g. "text_to_video", "text_to_image", "generate"
    params: dict[str, Any] = field(default_factory=dict)  # loop parameters (steps, guidance, prompt, ...)
    seed: int = 0  # seeds the per-request generator in LoopState
    priority: int = 0  # higher is admitted first among waiting requests
    arrival_s: float = field(default_factory=time.monotonic)  # monotonic submit time (FIFO tie-break)
    interceptors: tuple[Any, ...] = ()  # interceptors its model's deployment enabled (stateless objects)
