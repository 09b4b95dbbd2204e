"""fv-wan: Wan2.1 text-to-video and FastWan cards for fv.

Public helpers: the load shortcuts, the Wan loop's pure step bodies, the checkpoint helpers of the
diffusers layout. Training methods reach Wan only through ``fv_core.training.train_adapter``
(``fv_wan.training.WanTrainAdapter``), never by importing this package.
"""

from fv_wan.bodies import decode_body, denoise_body, encode_body, text_kv_body
from fv_wan.checkpoint import load_component
from fv_wan.generate import card, generate, load
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
