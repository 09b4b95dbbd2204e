"""How ``t2av-two-stage`` hands each stage its request: base at half size (latents out), the latent
upsampler on them, then refine at the requested size on fixed sigmas with guidance off. Latents pass
between stages in memory (``Request.carry``), with the weights versions the base stage pinned (the
whole program runs on the weights it started with, whatever weight sync lands meanwhile) and where the
base stage left its noise streams: the refine's re-noise continues them, as one generator handed through
diffusers' chained pipelines (and Lightricks' two-stage pipeline) does."""

from __future__ import annotations

from dataclasses import replace

from fv_core.loop import LoopResult
from fv_core.request import Request

GUIDANCE_OFF = dict(
    guidance_scale=1.0,
    stg_scale=0.0,
    modality_scale=1.0,
    audio_guidance_scale=1.0,
    audio_stg_scale=0.0,
    audio_modality_scale=1.0,
)
# guidance off leaves nothing to rescale (the guided prediction is the conditional one)
RESCALE_OFF = dict(guidance_rescale=0.0, audio_guidance_rescale=0.0)


def base(request: Request, results: dict[str, LoopResult]) -> Request:
    """Stage 0: the request at half height and width, ending with its latents."""
    p = request.params
    return replace(request, params=p.model_copy(update={"height": p.height // 2, "width": p.width // 2}),
                   carry={"latents_out": True})  # fmt: skip


def upsample(request: Request, results: dict[str, LoopResult]) -> Request:
    """Stage 1: the base stage's latents."""
    return replace(request, carry=_latents(results))


def refine(request: Request, results: dict[str, LoopResult]) -> Request:
    """Stage 2: the upsampled latents, re-noised to ``refine_noise_scale`` (unset: the first refine sigma)
    with the base stage's noise streams continued, on the refine sigmas."""
    p = request.params
    sigmas = p.refine_sigmas
    update = {"num_inference_steps": len(sigmas), "sigmas": sigmas, **GUIDANCE_OFF, **RESCALE_OFF}
    first = _base(results)
    carry = {
        **_latents(results),
        "noise_scale": p.refine_noise_scale if p.refine_noise_scale is not None else sigmas[0],
        "rng": first.outputs["rng"],
    }
    return replace(request, params=p.model_copy(update=update), carry=carry)


def _base(results: dict[str, LoopResult]) -> LoopResult:
    return next(iter(results.values()))


def _latents(results: dict[str, LoopResult]) -> dict:
    """The video and audio latents the last stage handed on."""
    outputs = list(results.values())[-1].outputs
    return {"latents": outputs["latents"], "audio_latents": outputs["audio_latents"]}
