"""fv-wan: Wan2.1 text-to-video and FastWan cards for fv.

Public helpers: the load shortcuts, the Wan loop's pure step bodies, the checkpoint helpers of the
diffusers layout. Training methods reach Wan only through ``fv_core.training.train_adapter``
(``fv_wan.training.WanTrainAdapter``), never by importing this package. The names below are imported on
first use, so loading the plugin (``fv plugins``, ``fv --help``) does not import torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_MODULE = {
    "decode_body": "bodies",
    "denoise_body": "bodies",
    "encode_body": "bodies",
    "text_kv_body": "bodies",
    "load_component": "checkpoint",
    "card": "shortcuts",
    "generate": "shortcuts",
    "load": "shortcuts",
    "WAN_SCHEDULER_CONFIG": "tiny",
    "word_tokenizer": "tiny",
    "write_pipeline_files": "tiny",
}
__all__ = sorted(_MODULE)


def __getattr__(name: str) -> Any:
    if name not in _MODULE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_MODULE[name]}"), name)
