"""LoRA adapters per request over one resident base (the adapter plane).

A served model's :class:`AdapterPlane` (``instance.adapters``) holds named LoRAs read from the files
people publish (:func:`read_lora`); requests name adapters and scales (``AdapterUse``), and every
targeted linear adds each row's adapters unmerged, so one batched call carries many. Cache keys of what
a targeted component makes add :func:`~fv_core.loop.pins.adapter_tag`. :class:`TrainableLora` trains pairs
through the same hooks; :func:`save_lora` writes them in diffusers' format.
"""

import fv_core.loop  # noqa: F401  # first: its runner imports adapters.rows, which imports loop.pins
from fv_core.adapters.files import LoraWeights, LowRank, read_lora, save_lora
from fv_core.adapters.plane import AdapterEntry, AdapterPlane
from fv_core.adapters.rows import AdapterUse, adapter_rows
from fv_core.adapters.synthetic import random_lora
from fv_core.adapters.train import TrainableLora
from fv_core.loop.pins import adapter_tag

__all__ = [
    "AdapterEntry",
    "AdapterPlane",
    "AdapterUse",
    "LoraWeights",
    "LowRank",
    "TrainableLora",
    "adapter_rows",
    "adapter_tag",
    "random_lora",
    "read_lora",
    "save_lora",
]
