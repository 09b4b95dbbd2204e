"""BAGEL's flow schedule and guided velocity (``Bagel.generate_image``)."""

from __future__ import annotations

import torch


def schedule(steps: int, shift: float) -> tuple[list[float], list[float]]:
    """BAGEL's flow times: ``steps`` points from 1 to 0, shifted; returns the times run and their Euler dts."""
    t = torch.linspace(1, 0, steps)
    t = shift * t / (1 + (shift - 1) * t)
    return t[:-1].tolist(), (t[:-1] - t[1:]).tolist()


def guide(
    v: torch.Tensor, v_text: torch.Tensor | None, v_img: torch.Tensor | None, text_scale: float, img_scale: float,
    renorm: str, renorm_min: float,
) -> torch.Tensor:  # fmt: skip
    """BAGEL's guided velocity: text CFG, then image CFG, renormed to at most the conditional's norm
    (``global``: over the whole image; ``channel``: per token; ``text_channel``: the text CFG per token)."""
    if v_text is None:
        return v
    guided = v_text + text_scale * (v - v_text)
    if renorm == "text_channel":
        scale = torch.norm(v, dim=-1, keepdim=True) / (torch.norm(guided, dim=-1, keepdim=True) + 1e-8)
        guided = guided * scale.clamp(min=renorm_min, max=1.0)
        return v_img + img_scale * (guided - v_img) if v_img is not None else guided
    if v_img is not None:
        guided = v_img + img_scale * (guided - v_img)
    if renorm == "global":
        scale = torch.norm(v) / (torch.norm(guided) + 1e-8)
    else:
        scale = torch.norm(v, dim=-1, keepdim=True) / (torch.norm(guided, dim=-1, keepdim=True) + 1e-8)
    return guided * scale.clamp(min=renorm_min, max=1.0)
