"""BAGEL's image edit loop (task ``edit``): the t2i denoise over an image's context.

The image is resized by the request's VAE-side transform (it sets the output's size), encoded by the
FLUX VAE (its clean latent tokens at flow time 0 on the generation expert) and, resized again by the ViT
transform, prefilled as understanding tokens (BAGEL's ``interleave_inference``). The contexts: cond =
[image latents, ViT, instruction]; text-unconditioned = the image alone; image-unconditioned = the
instruction alone.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from fv_bagel import bodies
from fv_bagel.context import plan_inputs
from fv_bagel.images import check_bounds, pixels, resize, to_pil, vit_bounds, vit_patches
from fv_bagel.state import DenoiseState
from fv_bagel.t2i_loop import ImageLoop, Pending
from fv_core import ConfigError
from fv_core.loop import LoopState, StepResult, WorkPlan, WorkUnitKind, pinned_module
from fv_core.request import NoiseDraws


class EditLoop(ImageLoop):
    """Image edit (task ``edit``): the image and the instruction in context, then t2i's denoise."""

    def _size(self, state: LoopState, request: Any, net: Any) -> tuple[int, int]:
        """The image resized by the VAE-side transform: its pixels (and ViT patches) kept for the
        prefills; its size is the output's."""
        image = next((part.image for part in request.parts if part.kind == "image"), None)
        if image is None:
            raise ConfigError("edit needs the image to edit. Fix: send one image part", param="image")
        inst, p = self.instance, request.params
        down = 8 * net.latent_patch_size
        check_bounds("vae_transform", p.vae_transform, down, net.max_latent_size * down, "the latent table")
        vae_image = resize(to_pil(image), p.vae_transform)
        x = pixels(vae_image)
        state.tensors["edit.pixels"] = x.permute(2, 0, 1)[None].to(inst.device)
        patches, ids = vit_patches(inst, net, resize(vae_image, vit_bounds(net, p)))
        state.tensors["image0.patches"], state.tensors["image0.ids"] = patches, ids
        return x.shape[0], x.shape[1]

    def _contexts(
        self, state: LoopState, request: Any, draws: NoiseDraws, text: dict[str, Any], contexts: dict[str, Any],
        grid: tuple[int, int],
    ) -> tuple[Pending, dict[str, str]]:  # fmt: skip
        """cond = [image (VAE latent, then ViT), instruction]; text-unconditioned = the image alone;
        image-unconditioned = the instruction alone. The encode's posterior noise is drawn here."""
        net = self._net(state)
        p, (rows, cols) = net.latent_patch_size, grid
        noise = draws.randn(1, net.latent_channels, p * rows, p * cols)
        state.tensors["edit.noise"] = noise.to(self.instance.device)
        pending: Pending = [
            ("text_uncond", "text_uncond", {"kind": "vae"}),
            ("text_uncond", "text_uncond", {"kind": "image", "index": 0}),
            ("cond", "text_uncond", text),
            ("img_uncond", "img_uncond", text),
        ]
        return pending, {}

    def _segment_plan(self, ctx: dict[str, Any], segment: dict[str, Any], state: LoopState) -> WorkPlan:
        """The edited image: its FLUX encode (VAE_TILE), then its clean latent tokens (flow time 0, the
        generation expert) between the vision markers, prefilled in full attention."""
        if segment["kind"] != "vae":
            return super()._segment_plan(ctx, segment, state)
        inst = self.instance
        if "edit.latent" not in state.tensors:
            return WorkPlan(
                kind=WorkUnitKind.VAE_TILE,
                body=partial(bodies.encode_body, pinned_module(inst, state, "vae")),
                inputs={"pixels": state.tensors["edit.pixels"], "noise": state.tensors["edit.noise"]},
                label="vae encode",
            )
        latent, n = state.tensors["edit.latent"], state.tensors["edit.latent"].shape[0]
        sp, dev = inst.special, inst.device
        inputs = plan_inputs(
            [ctx],
            latents=latent[None].to(inst.dtype),
            t=torch.zeros(1, device=dev),
            ids=torch.tensor([[sp["start_of_image"], sp["end_of_image"]]], device=dev),
            grid=state.tensors["grid"][None],
            pos=torch.full((1, n + 2), ctx["rope"], device=dev),
        )
        return WorkPlan(
            kind=WorkUnitKind.AR_PREFILL,
            body=partial(bodies.denoise_body, self._net(state), inst.exact),
            inputs=inputs,
            label=f"image {n} latent tokens",
        )

    def _tokens(self, state: LoopState, segment: dict[str, Any]) -> int:
        if segment["kind"] == "vae":
            rows, cols = DenoiseState.of(state).grid_shape
            return 2 + rows * cols
        return super()._tokens(state, segment)

    def advance(self, state: LoopState, result: StepResult) -> LoopState:
        s = DenoiseState.of(state)
        if s.pending and s.pending[0][2]["kind"] == "vae" and "edit.latent" not in state.tensors:
            rows, cols = s.grid_shape  # the encode ran: its latent as latent tokens
            net = self._net(state)
            p, c = net.latent_patch_size, net.latent_channels
            z = result.outputs["latent"][0].reshape(c, rows, p, cols, p)
            state.tensors["edit.latent"] = torch.einsum("chpwq->hwpqc", z).reshape(rows * cols, p * p * c)
            return state
        return super().advance(state, result)
