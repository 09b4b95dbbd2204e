"""``check_device``: a torch device name checked against this machine before anything is built on it."""

from __future__ import annotations

import torch

from fv_core.errors import ConfigError


def check_device(name: str, option: str = "device") -> torch.device:
    """``name`` as a torch device, or a ConfigError naming ``option``, the value, the rule and the fix
    (an unknown name, a CUDA device on a machine without one, an index past the last GPU)."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(
            f"{option}={name!r} is not a torch device ({exc}). Fix: cpu, cuda or cuda:<index>"
        ) from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError(
                f"{option}={name!r} asks for a GPU, but torch sees none on this machine (torch "
                f"{torch.__version__}, CUDA build: {torch.version.cuda is not None}). Fix: {option}=cpu, "
                "or run on a machine with a CUDA GPU and a CUDA build of torch"
            )
        if device.index is not None and device.index >= count:
            raise ConfigError(
                f"{option}={name!r}: this machine has {count} GPU(s), indices 0..{count - 1}. "
                f"Fix: one of cuda:0..cuda:{count - 1}"
            )
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"{option}={name!r}: MPS is not available on this machine. Fix: {option}=cpu")
    return device
