"""fv-wan: Wan2.1 text-to-video and FastWan cards for fv.

The public API other plugins may import (fv-train-flow trains on the serve loop's own step bodies):
the load shortcuts, the Wan loop's pure step bodies, the checkpoint helpers of the diffusers layout.
"""

from fv_wan.checkpoint import load_component
from fv_wan.generate import card, generate, load
from fv_wan.loop import decode_body, denoise_body, encode_body, text_kv_body
from fv_wan.tiny import WAN_SCHEDULER_CONFIG, word_tokenizer, write_pipeline_files

__all__ = [
    "WAN_SCHEDULER_CONFIG",
    "card",
    "decode_body",
    "denoise_body",
    "encode_body",
    "generate",
    "load",
    "load_component",
    "text_kv_body",
    "word_tokenizer",
    "write_pipeline_files",
]
