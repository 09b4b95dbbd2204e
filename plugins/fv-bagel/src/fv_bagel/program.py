"""How ``think-t2i`` hands each stage its request (BAGEL's ``interleave_inference(think=True)``): the AR
stage decodes a plan under BAGEL's generation-thinking system prompt, keeping its context after the
system prompt and after the prompt; the denoise stage reuses those caches as its text- and
image-unconditioned contexts and appends the thinking to the conditional one. The KV passes between
the stages in memory (``Request.carry``) on the one resident network: nothing is prefilled twice. The
carry also holds the weights versions the AR stage pinned, so a weight sync landing meanwhile leaves the
denoise stage on the weights that wrote the keys/values it reuses."""

from __future__ import annotations

from dataclasses import replace

from fv_bagel.params import ImageParams, TextParams
from fv_core.loop import LoopResult
from fv_core.request import Request

GEN_THINK_SYSTEM_PROMPT = (  # BAGEL's system prompt for thinking before an image (inferencer.py)
    "You should first think about the planning process in the mind and then generate the image. \n"
    "The planning process is enclosed within <think> </think> tags, i.e. <think> planning process here </think> "
    "image here"
)
TEXT_FIELDS = (
    "prompt",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "speculative_k",
    "speculative_ngram",
)


def think(request: Request, results: dict[str, LoopResult]) -> Request:
    """Stage 0: the AR decode of the thinking."""
    p = request.params
    params = TextParams(**{k: getattr(p, k) for k in TEXT_FIELDS}, stop=[], think=False)
    return replace(
        request, params=params, carry={"system_prompt": GEN_THINK_SYSTEM_PROMPT, "keep_contexts": True}
    )


def image(request: Request, results: dict[str, LoopResult]) -> Request:
    """Stage 1: the denoise over the AR stage's contexts, with its thinking appended."""
    p = request.params
    params = ImageParams(**{k: getattr(p, k) for k in ImageParams.model_fields})
    thought = list(results.values())[-1].outputs
    carry = {"contexts": thought["contexts"], "thinking": thought["text"]}
    return replace(request, params=params, carry=carry)
