"""Random LoRAs in diffusers' key layout, for tests and benchmarks on random-weight checkpoints."""

from __future__ import annotations

import torch


def random_lora(
    model: torch.nn.Module,
    targets: tuple[str, ...],
    rank: int = 4,
    seed: int = 0,
    prefix: str = "transformer",
    std: float = 0.3,
) -> dict[str, torch.Tensor]:
    """A rank-``rank`` pair on every linear of ``model`` whose path ends in one of ``targets``, keyed
    ``<prefix>.<path>.lora_A/B.weight`` as diffusers saves them."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for path, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and path.endswith(targets):
            out[f"{prefix}.{path}.lora_A.weight"] = torch.randn(rank, module.in_features, generator=g) * std
            out[f"{prefix}.{path}.lora_B.weight"] = torch.randn(module.out_features, rank, generator=g) * std
    return out
