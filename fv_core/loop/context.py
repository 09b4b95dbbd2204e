"""The context a loop is initialised with: profile, device, observers, interceptors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from fv_core.loop.contracts import Profile
from fv_core.loop.observers import BehaviorRecorder
from fv_core.loop.seam import check_interceptors


@dataclass(slots=True)
class LoopContext:
    """Passed to ``Loop.init``; shared by every request of one engine.

    Under ``Profile.ROLLOUT`` a BehaviorRecorder is added to the observers
    (unless one was given), so rollout is serve plus capture, one loop.
    """

    profile: Profile = Profile.SERVE  # serve / rollout (capture) / train (grad enabled)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # where loops allocate
    observers: tuple[Any, ...] = ()  # read-only Observer hooks (fv_core.extend.Observer)
    interceptors: tuple[
        Any, ...
    ] = ()  # step interceptors (applied in order) and at most one block interceptor
    recorder: BehaviorRecorder | None = None  # behaviour capture; set for the rollout profile

    def __post_init__(self) -> None:
        self.device = torch.device(self.device)
        check_interceptors(self.interceptors)
        if self.recorder is None:
            self.recorder = next((o for o in self.observers if isinstance(o, BehaviorRecorder)), None)
        if self.profile is Profile.ROLLOUT and self.recorder is None:
            self.recorder = BehaviorRecorder()
            self.observers = (*self.observers, self.recorder)


def grad_mode(profile: Profile) -> torch.set_grad_enabled:
    """Grad enabled under the train profile (it reuses the step body), disabled otherwise: torch's own
    context manager (no generator frames between bodies)."""
    return torch.set_grad_enabled(profile is Profile.TRAIN)
