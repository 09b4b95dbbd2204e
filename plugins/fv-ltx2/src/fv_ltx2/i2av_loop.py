"""Task ``i2av``: the t2av loop whose video's first frame is the request's image. The image is
re-compressed as LTX-2 was trained (H.264 at ``image_crf``), resized, VAE-encoded; its latent frame
stays clean (its tokens denoise at timestep 0 and are never stepped) while the rest starts from noise."""

from __future__ import annotations

from functools import partial

import torch

from fv_core.loop import Done, LoopState, StepResult, WorkPlan, WorkUnitKind, batch_key
from fv_core.request import ImagePart
from fv_ltx2.steps import encode_image_body, pack, unpack
from fv_ltx2.t2av_loop import LTX2Loop


class LTX2ImageLoop(LTX2Loop):
    """Loop ``i2av``: an ``encode_image`` phase after the prompt's, then the t2av loop's."""

    loop_id = "i2av"

    def init(self, request, instance=None, ctx=None) -> LoopState:
        images = [part for part in request.parts if part.kind == "image"]  # one: the loop requires it
        state = super().init(request, instance, ctx)
        state.tensors["image"] = self._preprocess(images[0], request.params).to(self.instance.device)
        if state.values["phase"] == "denoise":  # the prompt rows were cached: the image is next
            state.values["phase"] = "encode_image"
        return state

    def next(self, state: LoopState) -> WorkPlan | Done:
        if state.values["phase"] == "encode_image":
            return self._encode_image_plan(state, str(self.instance.dtype).removeprefix("torch."))
        return super().next(state)

    def advance(self, state: LoopState, result: StepResult) -> LoopState:
        if state.values["phase"] == "encode_image":
            self._condition(state, result.outputs["latents"])
            return state
        state = super().advance(state, result)
        if state.values["phase"] == "denoise" and "image" in state.tensors:  # text encoded: the image next
            state.values["phase"] = "encode_image"
        return state

    def _preprocess(self, image: ImagePart, p) -> torch.Tensor:
        """[1, 3, H, W] in -1..1: H.264 re-compressed at ``image_crf`` and resized as diffusers does."""
        from diffusers.pipelines.ltx2.utils import apply_image_conditioning_crf
        from diffusers.video_processor import VideoProcessor
        from PIL import Image

        pixels = image.pixels()
        pil = Image.fromarray(apply_image_conditioning_crf(pixels, p.image_crf) if p.image_crf else pixels)
        vae = self.instance.component("vae")
        processor = VideoProcessor(vae_scale_factor=vae.spatial_compression_ratio, resample="bilinear")
        return processor.preprocess(pil, height=p.height, width=p.width).to(torch.float32)

    def _encode_image_plan(self, state: LoopState, precision: str) -> WorkPlan:
        image = state.tensors["image"]
        return WorkPlan(
            kind=WorkUnitKind.VAE_TILE,
            body=partial(encode_image_body, self._module(state, "vae")),
            inputs={"image": image},
            batch_key=batch_key(self.instance, state, "vae", "vae_encode", tuple(image.shape[1:]), precision),
            label="encode image",
        )

    def _condition(self, state: LoopState, image_latents: torch.Tensor) -> None:
        """The first latent frame becomes the image's (normalized) latents; the mask marks its tokens."""
        t = state.tensors
        vae, transformer = self._module(state, "vae"), self._module(state, "transformer")
        shape = (1, -1, 1, 1, 1)
        mean, std = (
            vae.latents_mean.view(shape).to(image_latents),
            vae.latents_std.view(shape).to(image_latents),
        )
        frames, height, width = state.values["grid"]
        # no scaling_factor here, as diffusers
        clean = ((image_latents.float() - mean) / std).repeat(1, 1, frames, 1, 1)
        mask = torch.zeros((1, 1, frames, height, width), dtype=clean.dtype)
        mask[:, :, 0] = 1.0
        patch, patch_t = transformer.config.patch_size, transformer.config.patch_size_t
        noise = unpack(t["latents"], frames, height, width, patch, patch_t)  # drawn at init, as diffusers
        t["latents"] = pack(clean * mask + noise * (1 - mask), patch, patch_t)
        t["conditioning_mask"] = pack(mask, patch, patch_t).squeeze(-1)
        del t["image"]
        state.values["phase"] = "denoise"
