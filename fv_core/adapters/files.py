"""Reading the LoRA files people publish into per-module low-rank pairs.

Formats: diffusers' (``pytorch_lora_weights.safetensors``: ``<component>.<module>.lora_A/B.weight``, its
ranks and alphas in the file's ``lora_adapter_metadata``), PEFT's folder (``adapter_config.json`` +
``adapter_model.safetensors``: ``base_model.model.<module>.lora_A/B.weight``), and every format the
card's diffusers LoRA loader converts (original Wan, musubi, LTX-2's own ...): the tensors are read here
from safetensors only, then handed to that loader's ``lora_state_dict``, which converts them.

A module's scale is ``lora_alpha / r`` (``/ sqrt(r)`` with ``use_rslora``), per module where the file's
metadata or config has patterns, 1 where it says nothing (the diffusers/PEFT convention), times the
request's scale.
"""

from __future__ import annotations

import inspect
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from fv_core.errors import ConfigError
from fv_core.registry import resolve_lazy

DIFFUSERS_FILE = "pytorch_lora_weights.safetensors"
PEFT_CONFIG, PEFT_FILE = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
METADATA_KEY = "lora_adapter_metadata"  # where diffusers' save_lora_weights puts each prefix's LoraConfig
PICKLES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@dataclass(frozen=True, slots=True)
class LowRank:
    """One module's pair: ``delta(x) = scale * ((x @ down.T) @ up.T)``."""

    down: torch.Tensor  # lora_A [rank, in_features]
    up: torch.Tensor  # lora_B [out_features, rank]
    scale: float  # lora_alpha / rank (before the request's scale)

    @property
    def nbytes(self) -> int:
        return self.down.numel() * self.down.element_size() + self.up.numel() * self.up.element_size()


# component -> module path inside it -> its low-rank pair
LoraWeights = dict[str, dict[str, LowRank]]


def read_lora(path: str | Path, loader: str, components: list[str], default: str) -> LoraWeights:
    """The pairs in ``path`` (a file, or a folder holding one of the known file names), per component.

    ``loader``: ``"module:Class"`` of the diffusers LoRA loader mixin whose ``lora_state_dict`` converts
    this family's non-diffusers formats; ``components``: the card's components an adapter may target;
    ``default``: the component a PEFT folder's modules belong to (its keys carry no component prefix)."""
    file, config = _locate(Path(path))
    tensors, metadata = _read_safetensors(file)
    if config is not None:
        state = {f"{default}.{k.removeprefix(PEFT_PREFIX)}": v for k, v in tensors.items()}
        metadata = {f"{default}.{k}": v for k, v in config.items()}
    else:
        try:
            state = resolve_lazy(loader).lora_state_dict(tensors)
        except Exception as exc:  # diffusers' converters raise bare KeyError/ValueError on foreign files
            raise ConfigError(
                f"LoRA file {str(file)!r} is in no format this card's loader ({loader}) reads: "
                f"{type(exc).__name__}: {exc}. Fix: use a LoRA made for this model family."
            ) from None
        if isinstance(state, tuple):
            state = state[0]
    return _pairs(file, state, metadata or {}, components)


def _locate(path: Path) -> tuple[Path, dict[str, Any] | None]:
    """The safetensors file to read and, for a PEFT folder, its adapter config."""
    if path.suffix in PICKLES:
        raise ConfigError(
            f"adapter {str(path)!r} is a pickle file ({path.suffix}): loading it could run arbitrary code, so "
            "fv reads safetensors only. Fix: convert it to .safetensors, or use the safetensors file its "
            "publisher ships."
        )
    if path.is_dir():
        if (path / PEFT_CONFIG).is_file() and (path / PEFT_FILE).is_file():
            return path / PEFT_FILE, json.loads((path / PEFT_CONFIG).read_text())
        files = sorted(path.glob("*.safetensors"))
        named = [f for f in files if f.name == DIFFUSERS_FILE]
        if named or len(files) == 1:
            return (named or files)[0], None
        raise ConfigError(
            f"adapter folder {str(path)!r} holds {[f.name for f in files] or 'no .safetensors file'}; fv reads "
            f"{DIFFUSERS_FILE}, a PEFT folder ({PEFT_CONFIG} + {PEFT_FILE}) or a folder with one .safetensors "
            "file. Fix: name the file itself."
        )
    if not path.is_file():
        raise ConfigError(
            f"adapter {str(path)!r} does not exist. Fix: give the path of a LoRA .safetensors file."
        )
    if path.suffix != ".safetensors":
        raise ConfigError(
            f"adapter {str(path)!r} is not a .safetensors file. Fix: give a LoRA .safetensors file."
        )
    return path, None


def _read_safetensors(file: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    try:
        tensors = load_file(str(file))
        with safe_open(str(file), "pt") as handle:
            raw = (handle.metadata() or {}).get(METADATA_KEY)
    except (SafetensorError, OSError, ValueError) as exc:
        raise ConfigError(
            f"adapter {str(file)!r} is not a readable safetensors file ({exc}). Fix: download it again."
        ) from None
    return tensors, json.loads(raw) if raw else None


def _pairs(
    file: Path, state: dict[str, torch.Tensor], metadata: dict[str, Any], components: list[str]
) -> LoraWeights:
    """Group ``<component>.<module>.lora_A/B.weight`` keys into pairs with their scales."""
    unsupported = [k for k in state if not re.search(r"\.lora_[AB]\.weight$", k)]
    unconverted = [k for k in unsupported if re.search(r"\.lora_(down|up)\.weight$", k)]
    if unconverted:  # kohya-style pairs the card's loader left as they were: not this family's layout
        raise ConfigError(
            f"adapter {str(file)!r} holds LoRA pairs in a layout this model's LoRA loader does not convert "
            f"({unconverted[:2]}): a LoRA made for another model family, or by a trainer whose layout diffusers "
            "does not read for this one. Fix: use a LoRA made for this model."
        )
    if unsupported:
        raise ConfigError(
            f"adapter {str(file)!r} has tensors fv does not apply: {unsupported[:3]} (fv applies LoRA pairs "
            "lora_A/lora_B on linear layers; no DoRA, LoRA biases or embedding LoRAs). Fix: use a plain LoRA."
        )
    out: LoraWeights = {}
    for key in sorted(k for k in state if k.endswith(".lora_A.weight")):
        component, _, module = key.removesuffix(".lora_A.weight").partition(".")
        if component not in components:
            raise ConfigError(
                f"adapter {str(file)!r} targets {component!r} ({key}), which this card's adapters may not "
                f"(they may target {components}). Fix: use a LoRA made for this model."
            )
        down, up = state[key], state.get(f"{component}.{module}.lora_B.weight")
        if up is None or down.dim() != 2 or up.dim() != 2 or up.shape[1] != down.shape[0]:
            got = None if up is None else tuple(up.shape)
            raise ConfigError(
                f"adapter {str(file)!r}: module {component}.{module} has lora_A {tuple(down.shape)} and lora_B "
                f"{got}; a LoRA pair needs lora_A [rank, in] and lora_B [out, rank]. Fix: the file is damaged "
                "or not a LoRA; re-export it."
            )
        rank = down.shape[0]
        out.setdefault(component, {})[module] = LowRank(down, up, _scale(metadata, component, module, rank))
    if not out:
        raise ConfigError(f"adapter {str(file)!r} holds no LoRA pairs. Fix: give a LoRA .safetensors file.")
    return out


def _scale(metadata: dict[str, Any], component: str, module: str, rank: int) -> float:
    """``lora_alpha / r`` from the LoraConfig saved for ``component`` (module patterns first); 1 without one."""
    config = {
        k.removeprefix(f"{component}."): v for k, v in metadata.items() if k.startswith(f"{component}.")
    }
    if "lora_alpha" not in config:
        return 1.0
    alpha = _pattern(config.get("alpha_pattern") or {}, module, config["lora_alpha"])
    r = _pattern(config.get("rank_pattern") or {}, module, config.get("r", rank))
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def _pattern(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """A per-module value of a PEFT ``*_pattern`` (a key matches a module path's tail), else ``default``."""
    for key, value in patterns.items():
        if re.fullmatch(rf"(.*\.)?{key}", module):
            return value
    return default


def save_lora(folder: str | Path, loader: str, weights: LoraWeights) -> Path:
    """Write ``weights`` as diffusers does (the inverse of :func:`read_lora`): ``folder/``
    ``pytorch_lora_weights.safetensors`` with ``<component>.<module>.lora_A/B.weight`` keys and each
    component's ``r`` / ``lora_alpha`` / ``target_modules`` in the ``lora_adapter_metadata`` header,
    written by ``save_lora_weights`` of ``loader`` (the card's diffusers LoRA loader mixin). Every pair
    of a component must share one rank and one scale. Returns the file's path."""
    mixin, kwargs = resolve_lazy(loader), dict[str, Any]()
    for component, modules in weights.items():
        if f"{component}_lora_layers" not in inspect.signature(mixin.save_lora_weights).parameters:
            raise ConfigError(
                f"{loader}.save_lora_weights writes no {component!r} LoRA (diffusers' format for this family "
                f"has none). Fix: export LoRA pairs of the components it writes."
            )
        configs = {(p.down.shape[0], p.scale) for p in modules.values()}
        if len(configs) != 1:
            raise ConfigError(
                f"{component}'s LoRA pairs have {len(configs)} (rank, scale) settings {sorted(configs)[:3]}; "
                "the export writes one r and lora_alpha per component. Fix: train one rank and alpha."
            )
        ((rank, scale),) = configs
        kwargs[f"{component}_lora_layers"] = {
            f"{module}.lora_{ab}.weight": t.detach().cpu().contiguous()
            for module, pair in modules.items()
            for ab, t in (("A", pair.down), ("B", pair.up))
        }
        kwargs[f"{component}_lora_adapter_metadata"] = {
            "r": rank,
            "lora_alpha": scale * rank,
            "target_modules": sorted(modules),
        }
    mixin.save_lora_weights(str(folder), **kwargs)
    return Path(folder) / DIFFUSERS_FILE
