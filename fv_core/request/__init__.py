"""Requests, their parts and params, and stream events."""

from fv_core.loop.contracts import StreamEvent
from fv_core.request.noise import NoiseDraws, VariationParams
from fv_core.request.params import MAX_SEED, Params, param_meta
from fv_core.request.parts import AudioPart, ImagePart, Part, TextPart, VideoPart, image_part
from fv_core.request.request import Request

TERMINAL_EVENTS = frozenset({"done", "error", "cancelled"})  # kinds that end a request's stream

__all__ = [
    "MAX_SEED",
    "TERMINAL_EVENTS",
    "AudioPart",
    "ImagePart",
    "NoiseDraws",
    "Params",
    "Part",
    "Request",
    "StreamEvent",
    "TextPart",
    "VariationParams",
    "VideoPart",
    "image_part",
    "param_meta",
]
