"""The Qwen-Image-Edit loops (task ``edit``): VL encode -> VAE encode -> denoise steps -> VAE decode.

As diffusers' ``QwenImageEditPipeline`` (and ``QwenImageEditPlusPipeline``): the input image, resized
to ~1024 x 1024 pixels at its aspect ratio, goes through Qwen2.5-VL inside the prompt template (Plus:
each image at ~384 x 384, as "Picture k:") and through the VAE; its packed latents follow the noise
latents in the transformer's image stream (rope frame index 1, 2, ... per image) and the velocity is
read from the noise tokens only. Output size defaults from the (last) image. True CFG, the schedule,
the Euler update and the decode are the text-to-image loop's.

The VL features of each prompt row are cached by its tokens and the processed image; each image's
latents by the preprocessed pixels: a later edit of the same image skips both encoders (edits that start
together each encode it).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from fv_core import ConfigError
from fv_core.adapters import adapter_tag
from fv_core.cache import CacheKey
from fv_core.loop import (
    LoopResult,
    LoopState,
    StepResult,
    WorkPlan,
    WorkUnitKind,
    pinned,
    pinned_module,
    pinned_state,
)
from fv_core.request import NoiseDraws
from fv_qwen_image.bodies import pack
from fv_qwen_image.edit_params import CONDITION_AREA, MAX_IMAGES, TARGET_AREA, area_size
from fv_qwen_image.params import cfg_on, vae_scale
from fv_qwen_image.t2i_loop import QwenImageLoop, schedule
from fv_qwen_image.text_cache import ROWS
from fv_qwen_image.vae import encode_image
from fv_qwen_image.vl_encoder import edit_text, vl_encode_body


class QwenImageEditLoop(QwenImageLoop):
    """The Loop of Qwen-Image-Edit cards (one image), bound to one live QwenImageModel."""

    plus = False  # Edit Plus: several images, each seen by the VL encoder at ~384 x 384

    def init(self, request, instance=None, ctx=None) -> LoopState:
        inst = self.instance
        if instance is not None and instance is not inst:
            raise ConfigError("a QwenImageEditLoop runs requests on its own instance. Fix: model.loop(...)")
        p = request.params
        inst.components_for(request.task)
        images = self._images(request)
        scale = vae_scale(inst.card)
        vae_w, vae_h = area_size(TARGET_AREA, *images[-1].size)
        height, width = p.height or vae_h, p.width or vae_w
        self._check_size(height, width)
        state = pinned_state(request, inst, "edit", total_steps=p.num_inference_steps)
        cfg = cfg_on(p)
        rows = ROWS[: 2 if cfg else 1]
        vl_images, vae_pixels = self._preprocess(images, scale)
        processor = inst.component("processor")
        for row, prompt in zip(rows, (p.prompt, p.negative_prompt), strict=False):
            vl = processor(edit_text(str(prompt), len(images), self.plus), vl_images)
            state.tensors[f"ids.{row}"] = vl["input_ids"]
        state.tensors.update(vl_pixels=vl["pixel_values"], vl_grid=vl["image_grid_thw"])
        for k, pixels in enumerate(vae_pixels):
            state.tensors[f"pixels.{k}"] = pixels
        h, w = 2 * (height // (scale * 2)), 2 * (width // (scale * 2))  # latent rows, columns
        grids = [(1, h // 2, w // 2)] + [
            (1, x.shape[-2] // scale // 2, x.shape[-1] // scale // 2) for x in vae_pixels
        ]
        state.values.update(
            rows=list(rows), cfg=cfg, scale=p.true_cfg_scale, steps=p.num_inference_steps, size=(h, w),
            grids=grids, images=len(images), height=height, width=width,
        )  # fmt: skip
        state.values["cache_hits"], state.values["image_cache_hits"] = self._take_cached(state)
        channels = inst.config("transformer/config.json")["in_channels"] // 4
        noise = NoiseDraws(state.generator, p).randn(1, 1, channels, h, w)  # CPU generator, as diffusers
        state.tensors["latents"] = pack(noise).to(inst.device, inst.dtype)
        timesteps, sigmas = schedule(inst.scheduler_config, p.num_inference_steps, (h // 2) * (w // 2))
        state.tensors.update(timesteps=timesteps, sigmas=sigmas)
        return state

    def _images(self, request) -> list[Any]:
        """The request's image parts as 8-bit PIL images (what a user hands diffusers)."""
        from PIL import Image

        images = [Image.fromarray(part.pixels()) for part in request.parts if part.kind == "image"]
        want = f"1 to {MAX_IMAGES} images" if self.plus else "exactly one image"
        if not 1 <= len(images) <= (MAX_IMAGES if self.plus else 1):
            raise ConfigError(
                f"an edit takes {want}; the request has {len(images)}. Fix: send {want} (Python image=... or "
                "parts=[image_part(...), ...], HTTP 'image' file fields).",
                param="image",
            )
        return images

    def _check_size(self, height: int, width: int) -> None:
        cap = self.instance.card.capabilities.max_resolution
        if cap is not None and height * width > cap[0] * cap[1]:
            raise ConfigError(
                f"output size {width}x{height} exceeds this card's max resolution {cap[1]}x{cap[0]}. "
                "Fix: ask for a smaller height and width",
                param="height",
            )

    def _preprocess(self, images: list[Any], scale: int) -> tuple[list[Any], list[torch.Tensor]]:
        """The images the VL encoder sees and the VAE's pixels [1, 3, 1, H, W] in -1..1, resized as the
        pipeline resizes them (diffusers' own VaeImageProcessor: Lanczos)."""
        from diffusers.image_processor import VaeImageProcessor

        resizer = VaeImageProcessor(vae_scale_factor=scale * 2)
        vl, vae = [], []
        for image in images:
            vae_w, vae_h = area_size(TARGET_AREA, *image.size)
            if self.plus:
                cond_w, cond_h = area_size(CONDITION_AREA, *image.size)
                vl.append(resizer.resize(image, cond_h, cond_w))
                vae.append(resizer.preprocess(image, vae_h, vae_w).unsqueeze(2))
            else:
                vl.append(resizer.resize(image, vae_h, vae_w))
                vae.append(resizer.preprocess(vl[-1], vae_h, vae_w).unsqueeze(2))
        return vl, vae

    # -- the feature cache: VL rows by tokens and processed image, latents by pixels --------------

    def _key(self, state: LoopState, name: str) -> CacheKey:
        inst, t = self.instance, state.tensors
        if name.startswith("pixels."):
            return CacheKey.of(
                inst.card.model_id, "vae", pinned(state, "vae"), t[name], precision=str(inst.dtype)
            )
        return CacheKey.of(
            inst.card.model_id,
            "text_encoder",
            pinned(state, "text_encoder"),
            t[f"ids.{name}"][0],
            t["vl_pixels"],
            t["vl_grid"],
            precision=str(inst.dtype),
            adapters=adapter_tag(state, "text_encoder"),
        )

    def _take_cached(self, state: LoopState) -> tuple[int, int]:
        """Fill the rows and image latents the cache holds; return how many of each it held."""
        hits, cache = [0, 0], self.instance.feature_cache
        names = [*state.values["rows"], *(f"pixels.{k}" for k in range(state.values["images"]))]
        for name in names:
            cached = cache.get(self._key(state, name))
            if cached is not None:
                state.tensors[name.replace("pixels.", "latent.")] = cached.unsqueeze(0)
                hits[name.startswith("pixels.")] += 1
        return hits[0], hits[1]

    def _put(self, state: LoopState, name: str, value: torch.Tensor) -> None:
        state.tensors[name.replace("pixels.", "latent.")] = value
        self.instance.feature_cache.put(self._key(state, name), value[0])

    # -- phases ----------------------------------------------------------------------------------

    def _missing_image(self, state: LoopState) -> int | None:
        return next((k for k in range(state.values["images"]) if f"latent.{k}" not in state.tensors), None)

    def _phase(self, state: LoopState) -> str:
        if any(row not in state.tensors for row in state.values["rows"]):
            return "encode"
        if self._missing_image(state) is not None:
            return "vae_encode"
        return super()._phase(state)

    def next(self, state: LoopState):
        inst, t, phase = self.instance, state.tensors, self._phase(state)
        if phase == "encode":
            row = next(r for r in state.values["rows"] if r not in t)
            return WorkPlan(
                kind=WorkUnitKind.ENCODER_CHUNK,
                body=partial(vl_encode_body, pinned_module(inst, state, "text_encoder")),
                inputs={"input_ids": t[f"ids.{row}"], "pixel_values": t["vl_pixels"], "image_grid_thw": t["vl_grid"]},
                label=f"encode {'negative ' if row == 'neg_text' else ''}instruction with the image",
            )  # fmt: skip
        if phase == "vae_encode":
            k = self._missing_image(state)
            return WorkPlan(
                kind=WorkUnitKind.VAE_TILE,
                body=partial(vae_encode_body, pinned_module(inst, state, "vae")),
                inputs={"pixels": t[f"pixels.{k}"]},
                label=f"vae encode image {k + 1}",
            )
        return super().next(state)

    def _image_stream(self, state: LoopState) -> tuple[torch.Tensor, Any]:
        """The noise latents, then each input image's packed latents; the grid of each part."""
        t, v = state.tensors, state.values
        if "ref" not in t:  # the images' packed latents, in order
            ref = torch.cat([pack(t[f"latent.{k}"].transpose(1, 2)) for k in range(v["images"])], 1)
            t["ref"] = ref.to(self.instance.device, self.instance.dtype)
        return torch.cat([t["latents"], t["ref"].to(t["latents"].dtype)], 1), tuple(v["grids"])

    def advance(self, state: LoopState, result: StepResult) -> LoopState:
        phase = self._phase(state)
        if phase == "encode":
            row = next(r for r in state.values["rows"] if r not in state.tensors)
            self._put(state, row, result.outputs["embeds"])
        elif phase == "vae_encode":
            self._put(state, f"pixels.{self._missing_image(state)}", result.outputs["latents"])
        else:
            super().advance(state, result)
        return state

    def finalize(self, state: LoopState) -> LoopResult:
        result = super().finalize(state)
        v = state.values
        result.metrics.update(
            image_cache_hits=v["image_cache_hits"], images=v["images"], height=v["height"], width=v["width"]
        )
        return result

    def _cost(self, state: LoopState) -> float:
        cost = self.instance.card.loops[state.loop_id].step_cost
        tokens = sum(f * h * w for f, h, w in state.values["grids"])
        return (2 if state.values["cfg"] else 1) * (cost.base_s + cost.per_token_s * tokens)


class QwenImageEditPlusLoop(QwenImageEditLoop):
    """The Loop of Qwen-Image-Edit Plus cards (QwenImageEditPlusPipeline): one to MAX_IMAGES images."""

    plus = True


def vae_encode_body(vae, inputs: dict[str, Any]) -> dict[str, Any]:
    """The VAE's posterior mode of ``pixels`` [1, 3, 1, H, W] (-1..1), normalised with its latent
    statistics: ``latents`` [1, z, 1, H/8, W/8] (diffusers' ``_encode_vae_image``)."""
    z = encode_image(vae, inputs["pixels"].to(vae.device, vae.dtype))
    c = vae.config
    mean = torch.tensor(c.latents_mean).view(1, c.z_dim, 1, 1, 1).to(z.device, z.dtype)
    std = torch.tensor(c.latents_std).view(1, c.z_dim, 1, 1, 1).to(z.device, z.dtype)
    return {"latents": (z - mean) / std}
