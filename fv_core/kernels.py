"""Built-in kernels: the defaults every device can run."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sdpa_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """Dense attention over ``[batch, heads, tokens, head_dim]`` tensors (PyTorch SDPA)."""
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=attn_mask, is_causal=is_causal, scale=scale
    )
