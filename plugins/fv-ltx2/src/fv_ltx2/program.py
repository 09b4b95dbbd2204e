"""How ``t2av-two-stage`` hands each stage its request: base at half size (latents out), the latent
upsampler on them, then refine at the requested size on fixed sigmas with guidance off. Latents pass
between stages in memory (``Request.carry``), with the weights versions the base stage pinned: the
whole program runs on the weights it started with, whatever weight sync lands meanwhile."""

from __future__ import annotations

from dataclasses import replace

from fv_core import LoopResult, Request

GUIDANCE_OFF = dict(
    guidance_scale=1.0,
    stg_scale=0.0,
    modality_scale=1.0,
    audio_guidance_scale=1.0,
    audio_stg_scale=0.0,
    audio_modality_scale=1.0,
)


def base(request: Request, results: dict[str, LoopResult]) -> Request:
    """Stage 0: the request at half height and width, ending with its latents."""
    p = request.params
    return replace(request, params=p.model_copy(update={"height": p.height // 2, "width": p.width // 2}),
                   carry={"latents_out": True})  # fmt: skip


def upsample(request: Request, results: dict[str, LoopResult]) -> Request:
    """Stage 1: the base stage's latents."""
    return replace(request, carry={**list(results.values())[-1].outputs, "weights_versions": _pins(results)})


def refine(request: Request, results: dict[str, LoopResult]) -> Request:
    """Stage 2: the upsampled latents, re-noised to ``refine_noise_scale`` (unset: the first refine sigma),
    on the refine sigmas."""
    p = request.params
    sigmas = p.refine_sigmas
    params = p.model_copy(update={"num_inference_steps": len(sigmas), "sigmas": sigmas, **GUIDANCE_OFF})
    scale = p.refine_noise_scale if p.refine_noise_scale is not None else sigmas[0]
    carry = {**list(results.values())[-1].outputs, "noise_scale": scale, "weights_versions": _pins(results)}
    return replace(request, params=params, carry=carry)


def _pins(results: dict[str, LoopResult]) -> dict[str, str]:
    """The weights versions the base stage pinned at init (later stages keep them)."""
    return next(iter(results.values())).metrics["weights_versions"]
