"""A LoRA student (as DiffusionNFT publishes it: the policy trains low-rank adapters, not every weight).

At the rollout counts a CPU affords, a full fine-tune's update on the shapes model is mostly noise:
with random advantages it costs as much shape accuracy as the real reward gains (bench/nft_signal.py:
20 steps on one caption, KL 0.08 from noise alone). Rank-4 adapters confine each step to a few
directions per layer: there the same random advantages moved the model to KL 0.0003 and the real
reward beat them.

The adapters live on the student only (peft layers on its Linear modules); the old policy, the
reference and every exported checkpoint hold plain weights with the adapters folded in. The export also
writes the adapters alone in diffusers' LoRA format (``lora_weights`` -> ``fv_core.adapters.save_lora``,
the writer fv-train-flow's LoRA runs use), served per request over the starting checkpoint.
"""

from __future__ import annotations

import torch

from fv_core import ConfigError
from fv_core.adapters import LowRank


def add_lora(module: torch.nn.Module, rank: int, alpha: float, targets: list[str]) -> None:
    """Adapters of ``rank`` on the Linear layers whose names end with one of ``targets``; only the
    adapters train (B starts at zero, so the student starts equal to ``module``)."""
    from peft import LoraConfig, inject_adapter_in_model

    module.requires_grad_(False)
    inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets), module)
    for name, param in module.named_parameters():
        param.requires_grad_(is_lora(name))


def is_lora(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def merged_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s parameters under their plain names, each adapter's delta added to its layer's
    weight (a module without adapters: its parameters as they are)."""
    from peft.tuners.lora import LoraLayer

    deltas = {
        f"{name}.base_layer.weight": layer.get_delta_weight(adapter).detach()
        for name, layer in module.named_modules()
        if isinstance(layer, LoraLayer)
        for adapter in layer.active_adapters
    }
    return {
        name.replace(".base_layer.", "."): param.detach() + deltas[name] if name in deltas else param.detach()
        for name, param in module.named_parameters()
        if not is_lora(name)
    }


def lora_weights(module: torch.nn.Module) -> dict[str, LowRank]:
    """Each adapted layer's path (its name in the plain module) -> its pair and scale ``alpha / rank``."""
    from peft.tuners.lora import LoraLayer

    return {
        name: LowRank(layer.lora_A[a].weight.detach(), layer.lora_B[a].weight.detach(), layer.scaling[a])
        for name, layer in module.named_modules()
        if isinstance(layer, LoraLayer)
        for a in layer.active_adapters
    }


def lora_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' tensors (what a LoRA student's checkpoint adds to its base weights)."""
    return {name: p.detach().clone() for name, p in module.named_parameters() if is_lora(name)}


def load_lora_state(module: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy a checkpoint's adapters into ``module``'s (the same names, or a ConfigError)."""
    params = dict(module.named_parameters())
    differ = sorted(set(lora_state(module)) ^ set(tensors))
    if differ:
        raise ConfigError(
            f"the checkpoint's LoRA adapters do not match this run's ({len(differ)} differ, e.g. {differ[0]}). "
            "Fix: resume with the lora_rank and lora_targets the checkpoint was trained with"
        )
    with torch.no_grad():
        for name, value in tensors.items():
            params[name].copy_(value)
