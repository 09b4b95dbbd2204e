"""DiffusionNFT's math, free of any model: advantages, the optimality probability, the
negative-aware flow loss, the KL term and the old policy's decay schedule.

Notation (Wan's flow convention, as the paper's): ``x_t = (1 - t) x0 + t eps``, velocity
``v = eps - x0``, so a velocity predicts ``x0 = x_t - t v``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def advantages(rewards: torch.Tensor, groups: torch.Tensor, global_std: bool = True) -> torch.Tensor:
    """Per-prompt group-normalised advantages: ``(reward - group mean) / (std + 1e-4)`` with the
    whole batch's std (``global_std``, the published default) or the group's own."""
    rewards = rewards.double()
    out = torch.zeros_like(rewards)
    batch_std = rewards.std(unbiased=False)
    for g in groups.unique():
        member = groups == g
        group = rewards[member]
        std = batch_std if global_std else group.std(unbiased=False)
        out[member] = (group - group.mean()) / (std + 1e-4)
    return out.float()


def optimality(adv: torch.Tensor, clip_max: float) -> torch.Tensor:
    """The optimality probability ``r = 1/2 + clip(A / clip_max, -1, 1) / 2`` in [0, 1]."""
    return (adv / clip_max).clamp(-1, 1) / 2 + 0.5


def old_decay(step: int, rate: float, max_eta: float, flat: int = 0) -> float:
    """``eta`` after ``step`` optimisation steps: 0 for ``flat`` steps, then ``min(rate * (step -
    flat), max_eta)`` (the published schedule: rate 0.001, max 0.5, flat 0)."""
    return 0.0 if step < flat else min((step - flat) * rate, max_eta)


@torch.no_grad()
def blend_old(old: torch.nn.Module, student: dict[str, torch.Tensor], eta: float) -> None:
    """``old <- eta old + (1 - eta) student``, parameter by parameter (``student``: weights by
    parameter name), in place."""
    for name, o in old.named_parameters():
        o.copy_(o * eta + student[name] * (1.0 - eta))


@dataclass(slots=True)
class NftLoss:
    """The loss of one minibatch and its parts (per-sample means, then the batch mean)."""

    loss: torch.Tensor  # policy + kl_weight * kl
    policy: torch.Tensor  # adv_clip_max * mean(r L+ / beta + (1 - r) L- / beta)
    positive: torch.Tensor  # mean L+ (detached)
    negative: torch.Tensor  # mean L- (detached)
    kl: torch.Tensor  # mean ||v - v_ref||^2 (per element)


def nft_loss(
    v: torch.Tensor,
    v_old: torch.Tensor,
    v_ref: torch.Tensor,
    x_t: torch.Tensor,
    x0: torch.Tensor,
    t: torch.Tensor,
    r: torch.Tensor,
    beta: float,
    kl_weight: float,
    adv_clip_max: float,
    adaptive_weight: bool = True,
    weight: torch.Tensor | None = None,
) -> NftLoss:
    """The negative-aware flow loss at noise level ``t`` [B] on clean samples ``x0``.

    The implicit positive policy ``v+ = (1 - beta) v_old + beta v`` is pulled toward the data with
    weight ``r``, the implicit negative ``v- = (1 + beta) v_old - beta v`` with weight ``1 - r``; each
    error is measured on the x0 each predicts, divided (``adaptive_weight``) by its own stop-grad mean
    absolute error. With ``r = 1/2`` everywhere (no advantage) the two terms are mirror images around
    ``v_old``: without adaptive weights the loss is ``(||e||^2 + t^2 beta^2 ||v - v_old||^2) / beta``
    per element (``e`` the old policy's x0 error), whose gradient only pulls ``v`` back to ``v_old``.
    ``weight`` [B] scales each sample's policy and KL terms (default 1).
    """
    v_old, v_ref = v_old.detach(), v_ref.detach()
    dims = tuple(range(1, x0.ndim))
    te = t.view(-1, *([1] * (x0.ndim - 1)))
    positive = (1 - beta) * v_old + beta * v
    negative = (1 + beta) * v_old - beta * v
    pos = _x0_error(x_t - te * positive, x0, dims, adaptive_weight)
    neg = _x0_error(x_t - te * negative, x0, dims, adaptive_weight)
    w = torch.ones_like(r) if weight is None else weight.to(r.dtype)
    policy = adv_clip_max * (w * (r * pos / beta + (1 - r) * neg / beta)).mean()
    kl = (w * ((v - v_ref) ** 2).mean(dims)).mean()
    return NftLoss(policy + kl_weight * kl, policy, pos.mean().detach(), neg.mean().detach(), kl)


def _x0_error(pred: torch.Tensor, x0: torch.Tensor, dims: tuple[int, ...], adaptive: bool) -> torch.Tensor:
    err = (pred - x0) ** 2
    if adaptive:
        with torch.no_grad():
            weight = (pred.double() - x0.double()).abs().mean(dims, keepdim=True).clamp(min=1e-5)
        err = err / weight.to(err.dtype)
    return err.mean(dims)
