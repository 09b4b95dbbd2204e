"""The two losses of distribution matching, as plain functions of tensors (no modules, no adapter).

``dm_loss``: the generator's. The KL gradient between the student's output distribution and the
teacher's is estimated at a noisy copy of the sample by the difference of the fake and real x0
predictions, normalised per sample by ``mean|x0 - real|`` (DMD's weighting); it is applied as
``0.5 * ||x0 - sg(x0 - grad)||^2``, whose gradient on ``x0`` is ``grad`` (over the element count).

``flow_loss``: the critic's. Flow matching (velocity target ``noise - x0``) on the student's detached
samples, so the critic's score tracks the student's distribution.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def draw_sigmas(n: int, lo: float, hi: float, shift: float, gen: torch.Generator) -> torch.Tensor:
    """``n`` noise levels: uniform in ``[lo, hi]`` under the flow shift ``s*u / (1 + (s-1)*u)``."""
    u = lo + (hi - lo) * torch.rand(n, generator=gen)
    return shift * u / (1 + (shift - 1) * u)


def noised(x0: torch.Tensor, sigma: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """``x0`` [B, ...] at flow level ``sigma`` [B]."""
    s = sigma.view(-1, *([1] * (x0.dim() - 1)))
    return (1 - s) * x0 + s * noise


def dm_loss(x0: torch.Tensor, real: torch.Tensor, fake: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The distribution-matching loss on the sample ``x0`` (with grad) given the teacher's (``real``) and
    the critic's (``fake``) x0 predictions at its noisy copy; and the mean magnitude of its gradient."""
    with torch.no_grad():
        dims = tuple(range(1, x0.dim()))
        weight = (x0.detach() - real).abs().mean(dim=dims, keepdim=True)
        grad = torch.nan_to_num((fake - real) / weight)
    return 0.5 * F.mse_loss(x0, (x0 - grad).detach()), grad.abs().mean()


def flow_loss(velocity: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Flow matching: the predicted velocity against ``noise - x0``."""
    return F.mse_loss(velocity, noise - x0)
