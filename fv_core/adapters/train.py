"""A LoRA being trained on the adapter plane: the training forward is the serving forward.

:class:`TrainableLora` holds rank-``r`` pairs on the linears of one component whose paths end in one of
``targets`` (``down`` Kaiming-uniform and ``up`` zero, as PEFT starts them, so the model starts equal to
its base), registers those very tensors on the model's plane (``attach``), and ``applied()`` runs a body
with them on every row: the plane's forward hooks add ``alpha / r * (x A^T) B^T`` exactly as they do for
a served file, with gradients reaching the pairs and the base left frozen. ``save`` writes diffusers'
format (:func:`~fv_core.adapters.files.save_lora`), which the plane and diffusers' ``load_lora_weights``
both read back.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file

from fv_core.adapters.files import LowRank, save_lora
from fv_core.adapters.rows import AdapterUse, adapter_rows
from fv_core.errors import ConfigError


class TrainableLora(torch.nn.Module):
    """Trainable pairs over ``module`` (the live component ``component`` of a model with an adapter plane)."""

    def __init__(
        self,
        module: torch.nn.Module,
        rank: int,
        alpha: float,
        targets: list[str],
        component: str = "transformer",
    ) -> None:
        super().__init__()
        linears = [
            (path, m)
            for path, m in module.named_modules()
            if isinstance(m, torch.nn.Linear) and any(path == t or path.endswith(f".{t}") for t in targets)
        ]
        if not linears:
            names = [p for p, m in module.named_modules() if isinstance(m, torch.nn.Linear)]
            raise ConfigError(
                f"lora_targets={targets} match no linear layer of the {component} (its linears include "
                f"{names[:6]}). Fix: name module path suffixes such as 'attn1.to_q' or 'ffn.net.2'."
            )
        self.component, self.rank, self.alpha = component, rank, float(alpha)
        self.paths = [path for path, _ in linears]
        self.down = torch.nn.ParameterList()
        self.up = torch.nn.ParameterList()
        for _, linear in linears:
            w = linear.weight
            down = torch.empty(rank, linear.in_features, dtype=w.dtype, device=w.device)
            torch.nn.init.kaiming_uniform_(down, a=math.sqrt(5))
            self.down.append(torch.nn.Parameter(down))
            self.up.append(
                torch.nn.Parameter(torch.zeros(linear.out_features, rank, dtype=w.dtype, device=w.device))
            )
        self.use: AdapterUse | None = None

    def pairs(self) -> dict[str, LowRank]:
        """Module path -> its pair (the parameters themselves, not copies)."""
        scale = self.alpha / self.rank
        return {p: LowRank(d, u, scale) for p, d, u in zip(self.paths, self.down, self.up, strict=True)}

    def attach(self, plane, name: str) -> None:
        """Register the pairs on ``plane`` (a model's ``instance.adapters``) as adapter ``name`` and hold it
        for the life of the run, hooks installed on the component's live module."""
        entry = plane.add_weights(name, {self.component: self.pairs()})
        self.use = AdapterUse(name, entry.version, 1.0, entry.components)
        plane.hold(f"training:{name}", [self.use], {})

    @contextmanager
    def applied(self) -> Iterator[None]:
        """Run bodies (the serve loop's, under any profile) with these pairs on every row."""
        if self.use is None:
            raise ConfigError(
                "this LoRA is on no adapter plane yet. Fix: call attach(model.instance.adapters, name)."
            )
        with adapter_rows(((self.use,),)):  # one row's adapters, repeated over every leading row
            yield

    def save(self, folder: str | Path, loader: str) -> Path:
        """``folder/pytorch_lora_weights.safetensors`` in diffusers' format (``loader``: the card's
        ``adapters.loader``); returns the file."""
        return save_lora(folder, loader, {self.component: self.pairs()})

    @torch.no_grad()
    def load(self, file: str | Path) -> None:
        """Copy the pairs of a file :meth:`save` wrote (same targets and rank) into these parameters."""
        tensors = load_file(str(file))
        expected = {
            f"{self.component}.{p}.lora_{ab}.weight": t
            for p, d, u in zip(self.paths, self.down, self.up, strict=True)
            for ab, t in (("A", d), ("B", u))
        }
        differ = sorted(set(expected) ^ set(tensors))
        wrong = [k for k in expected if k in tensors and tensors[k].shape != expected[k].shape]
        if differ or wrong:
            raise ConfigError(
                f"LoRA file {str(file)!r} does not match this run's pairs ({len(differ)} names differ, e.g. "
                f"{differ[:2]}; {len(wrong)} shapes differ). Fix: resume with the lora_rank and lora_targets "
                "it was trained with."
            )
        for key, param in expected.items():
            param.copy_(tensors[key])
