"""The refine stage of ``t2av-two-stage``: the t2av loop started from the upsampled latents its program
hands on (``request.carry``), re-noised to ``noise_scale`` with the noise streams the base stage left off,
denoised on fixed float sigmas (no dynamic shift, no terminal stretch) with guidance off, then decoded."""

from __future__ import annotations

from functools import partial
from typing import Any

from fv_core.loop import LoopState, pinned
from fv_ltx2.steps import lora_denoise_body, noise_draws, pack
from fv_ltx2.t2av_loop import LTX2Loop


class LTX2RefineLoop(LTX2Loop):
    """Loop ``refine``: with the card's refine LoRA shipped in the folder, its transformer runs with it
    merged; a request's adapters apply unmerged on top, as in every stage."""

    loop_id = "refine"
    block_seam = False  # 3 distilled steps (nothing to cache) on LoRA-merged weights
    prompt_kv = False  # its calls run the text through the LoRA-merged weights (functional_call)
    schedule_overrides = {"use_dynamic_shifting": False, "shift_terminal": None}

    def _extra_metrics(self, state: LoopState) -> dict[str, Any]:
        return {"refine_lora": bool(self.instance.refine_weights(pinned(state, "transformer")))}

    def _denoise(self, statics: dict[str, Any], branch: str, version: str | None = None):
        """The transformer call with the refine LoRA merged into ``version``'s weights, when shipped."""
        weights = self.instance.refine_weights(version)
        if not weights:
            return super()._denoise(statics, branch, version)
        transformer = self.instance.component("transformer", version)
        return partial(lora_denoise_body, transformer, weights, statics, branch)

    def _sizes(self, request) -> tuple[tuple[int, int, int], int]:
        video, audio = request.carry["latents"], request.carry["audio_latents"]
        return tuple(video.shape[2:]), audio.shape[2]  # type: ignore[return-value]

    def _start_latents(self, state: LoopState, request, grid: tuple[int, ...], audio_frames: int) -> None:
        """The handed-on latents, normalized and packed, mixed with fresh noise: ``scale·n + (1−scale)·x``
        (video, then audio: the order diffusers draws them)."""
        draws, scale = noise_draws(state, request), request.carry["noise_scale"]
        vae, audio_vae, transformer = (self._module(state, n) for n in ("vae", "audio_vae", "transformer"))
        video = request.carry["latents"].float()
        shape = (1, -1, 1, 1, 1)
        mean, std = vae.latents_mean.view(shape).to(video), vae.latents_std.view(shape).to(video)
        video = pack(
            (video - mean) * vae.config.scaling_factor / std,
            transformer.config.patch_size,
            transformer.config.patch_size_t,
        )
        noise = draws.randn(*video.shape, dtype=video.dtype)
        audio = request.carry["audio_latents"].float().transpose(1, 2).flatten(2, 3)
        audio = (audio - audio_vae.latents_mean.to(audio)) / audio_vae.latents_std.to(audio)
        audio_noise = draws.randn(*audio.shape, dtype=audio.dtype)
        state.tensors.update(
            latents=scale * noise + (1 - scale) * video,
            audio_latents=scale * audio_noise + (1 - scale) * audio,
        )
        self._end_draws(state, draws, vae, grid)
