"""TaylorSeer: forecast a cached residual from its finite differences at computed steps.

As in ``cache-dit``'s TaylorSeer calibrator: at a computed step ``s`` the
derivative ladder is ``dY[0] = Y``, ``dY[i+1] = (dY[i] - prev[i]) / (s - last)``
(``last``: the previous computed step, ``prev``: its ladder); at a cached
step ``s`` the forecast is ``sum_i dY[i] * (s - last)**i / i!``. The
package's calibrator starts its derivatives two steps later; fv uses them as
soon as a previous ladder exists.

State is plain data in the branch's cache dict (``taylor_dY``, ``taylor_last``),
rebound on every update, never mutated in place.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def taylor_update(cache: dict[str, Any], step: int, value: torch.Tensor, order: int) -> None:
    """Record ``value`` computed at ``step``: a new derivative ladder of up to ``order`` derivatives."""
    prev: list[torch.Tensor] = cache.get("taylor_dY", [])
    window = step - cache.get("taylor_last", step)
    ladder = [value]
    for i in range(min(order, len(prev))):
        ladder.append((ladder[i] - prev[i]) / window)
    cache["taylor_dY"], cache["taylor_last"] = ladder, step


def taylor_forecast(cache: dict[str, Any], step: int) -> torch.Tensor:
    """The Taylor expansion of the last ladder at ``step``."""
    ladder: list[torch.Tensor] = cache["taylor_dY"]
    elapsed = step - cache["taylor_last"]
    out = ladder[0]
    for i in range(1, len(ladder)):
        out = out + ladder[i] * (elapsed**i / math.factorial(i))
    return out
