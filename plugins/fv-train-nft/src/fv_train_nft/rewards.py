"""fv-train-nft's rewards.

- ``constant``: ``value`` for every sample, whatever it shows (the control of a reward run: group
  advantages are all zero, so r = 1/2 everywhere).
- ``shapes-position-debiased``: fv-train-flow's ``shapes-detector`` score minus what the object's
  start position alone predicts of it in this batch. On the shapes model, squares that start far from
  the frame's centre are drawn rounded more often (the parent at guidance 1: shape accuracy 1.00 for
  starts within 8 px of the centre, 0.53 for squares 14-20 px out), so the plain score also rewards
  starting near the centre, which the prompt does not ask for: a run on it narrows where objects
  start. Here, per asked shape, a least-squares line of score against the start's distance from the
  centre is fitted over the batch and each score becomes ``score - line(distance) + mean score``: a
  sample's advantage is how much better it is than samples starting as far out, so moving the object
  inward earns nothing. Clips with no object (score 0, no position) keep their score and stay out of
  the fit.
"""

from __future__ import annotations

from typing import Any

import torch


class ConstantReward:
    def __init__(self, value: float = 1.0) -> None:
        self.value = float(value)

    def __call__(self, frames: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        return torch.full((frames.shape[0],), self.value)


class PositionDebiasedShapesReward:
    """``shapes-position-debiased``: options are the ``shapes-detector``'s (weights, soft,
    temperature); see the module docstring."""

    MIN_FIT = 4  # fewer positioned samples of a shape: their scores are left as they are

    def __init__(self, **options: Any) -> None:
        from fv_train_flow.reward import ShapesDetectorReward

        self.base = ShapesDetectorReward(**options)

    def __call__(self, frames: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        from fv_train_flow.detect import detect
        from fv_train_flow.reward import parse

        asked = [parse(p) for p in prompts]
        found = [detect(clip) for clip in frames]
        scores = torch.tensor([self.base.score(f, a) for f, a in zip(found, asked, strict=True)])
        centre = frames.shape[3] / 2, frames.shape[2] / 2  # (x, y) pixels
        dist = torch.tensor(
            [
                float("nan")
                if f.start is None
                else ((f.start[0] - centre[0]) ** 2 + (f.start[1] - centre[1]) ** 2) ** 0.5
                for f in found
            ]
        )
        return debias(scores, dist, [a[1] for a in asked], self.MIN_FIT)


def debias(scores: torch.Tensor, dist: torch.Tensor, shapes: list[str], min_fit: int = 4) -> torch.Tensor:
    """Per shape: ``score - (a + b dist) + mean`` with ``a + b dist`` the least-squares line over that
    shape's samples with a position (``dist`` not NaN); the others are returned unchanged."""
    out = scores.clone().double()
    for shape in sorted(set(shapes)):
        rows = torch.tensor([s == shape for s in shapes]) & ~dist.isnan()
        if int(rows.sum()) < min_fit:
            continue
        x, y = dist[rows].double(), scores[rows].double()
        xc = x - x.mean()
        slope = (xc * (y - y.mean())).sum() / (xc * xc).sum().clamp(min=1e-9)
        out[rows] = y - slope * xc
    return out.float()
