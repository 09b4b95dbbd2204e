"""The middle stage of ``t2av-two-stage``: the card's latent upsampler on the base stage's video latents
(one VAE_TILE unit); the audio latents pass through."""

from __future__ import annotations

from functools import partial

from fv_core.loop import (
    Done,
    LoopResult,
    LoopState,
    StepResult,
    WorkPlan,
    WorkUnitKind,
    batch_key,
    pinned_module,
    pinned_state,
)
from fv_ltx2.model import LTX2Model
from fv_ltx2.steps import upsample_body


class LTX2UpsampleLoop:
    """Loop ``upsample``: it holds the program's pinned weights versions while the upsampler runs, so the
    refine stage finds them."""

    loop_id = "upsample"

    def __init__(self, instance: LTX2Model) -> None:
        self.instance = instance

    def init(self, request, instance=None, ctx=None) -> LoopState:
        state = pinned_state(request, self.instance, self.loop_id, total_steps=1)
        state.tensors.update(latents=request.carry["latents"], audio_latents=request.carry["audio_latents"])
        return state

    def next(self, state: LoopState) -> WorkPlan | Done:
        if state.step:
            return Done()
        inst, latents = self.instance, state.tensors["latents"]
        precision = str(inst.dtype).removeprefix("torch.")
        return WorkPlan(
            kind=WorkUnitKind.VAE_TILE,
            body=partial(upsample_body, pinned_module(inst, state, "latent_upsampler")),
            inputs={"latents": latents},
            batch_key=batch_key(
                inst, state, "latent_upsampler", "upsample", tuple(latents.shape[1:]), precision
            ),
            label="latent upsample x2",
        )

    def advance(self, state: LoopState, result: StepResult) -> LoopState:
        state.tensors["latents"] = result.outputs["latents"]
        state.step = 1
        return state

    def finalize(self, state: LoopState) -> LoopResult:
        return LoopResult(
            {"latents": state.tensors["latents"], "audio_latents": state.tensors["audio_latents"]}
        )
