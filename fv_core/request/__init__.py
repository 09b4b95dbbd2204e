"""Requests, their parts and params, and stream events."""

from fv_core.loop.contracts import StreamEvent
from fv_core.request.params import Params, param_meta
from fv_core.request.parts import AudioPart, ImagePart, Part, TextPart, VideoPart, image_part
from fv_core.request.request import Request

TERMINAL_EVENTS = frozenset({"done", "error", "cancelled"})  # kinds that end a request's stream

__all__ = [
    "TERMINAL_EVENTS",
    "AudioPart",
    "ImagePart",
    "Params",
    "Part",
    "Request",
    "StreamEvent",
    "TextPart",
    "VideoPart",
    "image_part",
    "param_meta",
]
