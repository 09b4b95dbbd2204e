"""The FLUX autoencoder BAGEL ships as ``ae.safetensors`` (Black Forest Labs' own key names), run as
diffusers' ``AutoencoderKL`` with the FLUX configuration.

diffusers' single-file converter (``convert_ldm_vae_checkpoint``) maps the BFL keys to its own; the
configuration is FLUX's (16 latent channels, x8, no quant convs, scale 0.3611, shift 0.1159) with the
channel widths and block count read from the file's shapes, so a smaller autoencoder in the same
layout (the tiny card's) loads the same way. ``to_bfl`` is the inverse map, used to write one.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from fv_core import WeightsError

SCALING_FACTOR, SHIFT_FACTOR = 0.3611, 0.1159  # FLUX.1's latent normalisation (BAGEL's load_ae)


def flux_config(
    block_out_channels: list[int], layers_per_block: int, latent_channels: int = 16
) -> dict[str, Any]:
    """diffusers' AutoencoderKL config of the FLUX autoencoder (FLUX.1-dev ``vae/config.json``)."""
    levels = len(block_out_channels)
    return {
        "in_channels": 3,
        "out_channels": 3,
        "down_block_types": ["DownEncoderBlock2D"] * levels,
        "up_block_types": ["UpDecoderBlock2D"] * levels,
        "block_out_channels": list(block_out_channels),
        "layers_per_block": layers_per_block,
        "act_fn": "silu",
        "latent_channels": latent_channels,
        "norm_num_groups": 32,
        "sample_size": 1024,
        "scaling_factor": SCALING_FACTOR,
        "shift_factor": SHIFT_FACTOR,
        "force_upcast": True,
        "use_quant_conv": False,
        "use_post_quant_conv": False,
        "mid_block_add_attention": True,
    }


FLUX_CONFIG = flux_config([128, 256, 512, 512], 2)


def config_from_state(state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The FLUX config whose shapes this BFL-layout state dict has."""
    try:
        levels = 1 + max(int(m.group(1)) for k in state if (m := re.match(r"encoder\.down\.(\d+)\.", k)))
        widths = [int(state[f"encoder.down.{i}.block.0.conv2.weight"].shape[0]) for i in range(levels)]
        blocks = 1 + max(
            int(m.group(1)) for k in state if (m := re.match(r"encoder\.down\.0\.block\.(\d+)\.", k))
        )
        latent = int(state["decoder.conv_in.weight"].shape[1])
    except (ValueError, KeyError) as exc:
        raise WeightsError(
            f"ae.safetensors does not hold a FLUX autoencoder in Black Forest Labs' layout (missing {exc}). "
            "Fix: use the ae.safetensors BAGEL ships (FLUX.1's autoencoder)."
        ) from None
    return flux_config(widths, blocks, latent)


def load_flux_vae(path: Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> Any:
    """diffusers' AutoencoderKL with ``ae.safetensors``'s weights (every key used, none missing)."""
    from diffusers import AutoencoderKL
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint
    from safetensors.torch import load_file

    state = load_file(str(path))
    config = config_from_state(state)
    converted = convert_ldm_vae_checkpoint(state, config)
    vae: Any = AutoencoderKL(**config)
    missing, unexpected = vae.load_state_dict(converted, strict=False)
    if missing or unexpected:
        raise WeightsError(
            f"{str(path)!r} does not fit the FLUX autoencoder: missing {missing[:5]}, unexpected "
            f"{unexpected[:5]}. Fix: use the ae.safetensors BAGEL ships."
        )
    vae = vae.to(device=device)
    return (vae if dtype == torch.float32 else vae.to(dtype=dtype)).eval()


def _rename(key: str, levels: int) -> str:
    """One diffusers AutoencoderKL key as BFL names it."""
    key = key.replace("conv_norm_out", "norm_out")
    key = re.sub(r"mid_block\.resnets\.(\d)", lambda m: f"mid.block_{int(m.group(1)) + 1}", key)
    key = key.replace("mid_block.attentions.0.", "mid.attn_1.")
    for old, new in (
        ("group_norm", "norm"),
        ("to_q", "q"),
        ("to_k", "k"),
        ("to_v", "v"),
        ("to_out.0", "proj_out"),
    ):
        key = key.replace(f"attn_1.{old}.", f"attn_1.{new}.")
    key = re.sub(r"encoder\.down_blocks\.(\d+)\.resnets\.", r"encoder.down.\1.block.", key)
    key = re.sub(r"encoder\.down_blocks\.(\d+)\.downsamplers\.0\.", r"encoder.down.\1.downsample.", key)
    # diffusers counts decoder blocks from the lowest resolution, BFL from the highest
    key = re.sub(
        r"decoder\.up_blocks\.(\d+)\.resnets\.",
        lambda m: f"decoder.up.{levels - 1 - int(m.group(1))}.block.",
        key,
    )
    key = re.sub(
        r"decoder\.up_blocks\.(\d+)\.upsamplers\.0\.",
        lambda m: f"decoder.up.{levels - 1 - int(m.group(1))}.upsample.",
        key,
    )
    return key.replace("conv_shortcut", "nin_shortcut")


def to_bfl(state: dict[str, torch.Tensor], levels: int) -> dict[str, torch.Tensor]:
    """A diffusers AutoencoderKL state dict in BFL's ``ae.safetensors`` names (attention projections as
    1x1 convolutions)."""
    out = {}
    for key, value in state.items():
        name = _rename(key, levels)
        if ".attn_1." in name and name.endswith(".weight") and value.dim() == 2:
            value = value[:, :, None, None]
        out[name] = value.contiguous()
    return out
