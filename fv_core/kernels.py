"""Built-in kernels and the call signature each op's kernels must take.

An ``attention`` kernel is called as
``kernel(query, key, value, attn_mask=None, is_causal=False, scale=None, **context)`` on
``[batch, heads, tokens, head_dim]`` tensors and returns the output in the query's layout.
``context`` holds what a model family states for kernels that ask for it by name (Wan: the
latent token ``grid`` and the ``card`` id). A kernel may be an object with
``with_options(options)``: it is then bound to its plugin's validated options at load.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F

from fv_core.errors import ConfigError

# op -> parameters a kernel must accept by these names (positionally, in this order, for the first three)
SIGNATURES: dict[str, tuple[str, ...]] = {
    "attention": ("query", "key", "value", "attn_mask", "is_causal", "scale"),
    "packed_attention": ("query", "key", "value", "cu_seqlens", "scale"),  # see fv_core.kernels_packed
}


def check_kernel(key: Any, impl: Any) -> None:
    """Raise ConfigError when ``impl`` cannot be called with its op's signature (unknown ops pass)."""
    op = key[0] if isinstance(key, tuple) else key
    needed = SIGNATURES.get(op)
    if needed is None:
        return
    try:
        params = inspect.signature(impl).parameters
    except (TypeError, ValueError):
        raise ConfigError(f"kernel {key!r}: {impl!r} is not callable. Fix: register a function.") from None
    names = [p.name for p in params.values() if p.kind is not p.VAR_KEYWORD]
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    missing = [n for n in needed if n not in names and not (takes_any and n not in needed[:3])]
    if missing or names[:3] != list(needed[:3]):
        raise ConfigError(
            f"kernel {key!r} takes ({', '.join(names)}); an {op!r} kernel must take "
            f"({', '.join(needed)}) (missing: {missing or 'none'}; the first three positionally). "
            "Fix: give it that signature (see fv_core.kernels)."
        )


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
