"""The Qwen-Image loop (task ``t2i``): encode -> denoise steps -> VAE decode.

Each phase is its own WorkUnit: ENCODER_CHUNK (Qwen2.5-VL over the templated prompt, one row per plan
since rows of other lengths never pad; skipped on a feature-cache hit), DIFFUSION_STEP (one
transformer call per step, or two under true CFG) and VAE_TILE (the decode). Step bodies
(:mod:`fv_qwen_image.bodies`) are pure functions of their inputs, so the runtime batches equal-keyed
plans of different requests: same image size, true CFG on or off, same pinned weights (prompts of other lengths zero-padded and
masked, as diffusers masks a padded batch). When the deploy selects a ``packed_attention`` kernel,
denoise steps take the packed form instead: requests of any size and prompt length share one call as
one sequence (:func:`fv_qwen_image.transformer.qwen_forward_packed`), within the card's tolerance of
each alone; with the ``segments`` kernel, ``determinism: bitwise`` packs them too, bit for bit each alone
(``WorkPlan.invariant_body``: the linears per request). True CFG's
combine, its norm rescale and the Euler update run per request in ``advance``.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np
import torch

from fv_core import ConfigError
from fv_core.extend import BLOCKS_INPUT
from fv_core.loop import (
    Done,
    LoopResult,
    LoopState,
    StepResult,
    WorkPlan,
    WorkUnitKind,
    batch_key,
    pinned,
    pinned_module,
    pinned_state,
)
from fv_core.request import NoiseDraws
from fv_qwen_image.bodies import decode_body, denoise_body, encode_body, pack
from fv_qwen_image.model import QwenImageModel
from fv_qwen_image.params import cfg_on
from fv_qwen_image.text_cache import ROWS, put_row, take_cached, tokenize


def calculate_shift(tokens: int, config: dict[str, Any]) -> float:
    """The schedule's mu for an image of ``tokens`` packed latents: linear between the scheduler
    config's (base_image_seq_len, base_shift) and (max_image_seq_len, max_shift), as the pipeline does."""
    base_len, max_len = config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096)
    base, top = config.get("base_shift", 0.5), config.get("max_shift", 1.15)
    slope = (top - base) / (max_len - base_len)
    return tokens * slope + (base - slope * base_len)


def schedule(config: dict[str, Any], steps: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Timesteps and sigmas (steps + 1, the last 0) of the checkpoint's FlowMatchEuler scheduler for
    ``linspace(1, 1/steps, steps)`` shifted by mu (dynamic shifting)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    if config.get("stochastic_sampling"):
        raise ConfigError(
            "the checkpoint's scheduler sets stochastic_sampling=true; fv's Qwen-Image loop runs the "
            "deterministic Euler step. Fix: set stochastic_sampling to false in scheduler_config.json."
        )
    if steps == 1 and config.get("shift_terminal"):
        raise ConfigError(
            f"num_inference_steps=1: the checkpoint's scheduler stretches its sigmas to end at shift_terminal="
            f"{config['shift_terminal']}, which takes at least 2 steps (one step makes NaN timesteps in diffusers "
            "too). Fix: use num_inference_steps=2 or more",
            param="num_inference_steps",
        )
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)
    sigmas = np.linspace(1.0, 1 / steps, steps)
    mu = calculate_shift(tokens, config) if config.get("use_dynamic_shifting") else None
    scheduler.set_timesteps(sigmas=sigmas, mu=mu)
    return scheduler.timesteps, scheduler.sigmas


def true_cfg(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """``uncond + scale (cond - uncond)``, rescaled per token to the conditional velocity's norm."""
    combined = uncond + scale * (cond - uncond)
    cond_norm = torch.norm(cond, dim=-1, keepdim=True)
    return combined * (cond_norm / torch.norm(combined, dim=-1, keepdim=True))


class QwenImageLoop:
    """The Loop of Qwen-Image cards, bound to one live QwenImageModel. Holds no request state."""

    def __init__(self, instance: QwenImageModel) -> None:
        self.instance = instance

    def init(self, request, instance=None, ctx=None) -> LoopState:
        inst = self.instance
        if instance is not None and instance is not inst:
            raise ConfigError("a QwenImageLoop runs requests on its own instance. Fix: model.loop(...)")
        p = request.params
        inst.components_for(request.task)
        state = pinned_state(request, inst, "t2i", total_steps=p.num_inference_steps)
        cfg = cfg_on(p)
        rows = ROWS[: 2 if cfg else 1]
        tok = inst.component("tokenizer")
        for row, prompt in zip(rows, (p.prompt, p.negative_prompt), strict=False):
            state.tensors[f"ids.{row}"] = tokenize(tok, prompt)
        h, w = 2 * (p.height // 16), 2 * (p.width // 16)  # latent rows, columns (VAE x8)
        state.values.update(
            rows=list(rows),
            cfg=cfg,
            scale=p.true_cfg_scale,
            steps=p.num_inference_steps,
            max_sequence_length=p.max_sequence_length,
            size=(h, w),
        )
        state.values["cache_hits"] = take_cached(inst, state)
        channels = inst.config("transformer/config.json")["in_channels"] // 4
        noise = NoiseDraws(state.generator, p).randn(1, 1, channels, h, w)  # CPU generator, as diffusers
        state.tensors["latents"] = pack(noise).to(inst.device, inst.dtype)
        timesteps, sigmas = schedule(inst.scheduler_config, p.num_inference_steps, (h // 2) * (w // 2))
        state.tensors.update(timesteps=timesteps, sigmas=sigmas)
        return state

    def _phase(self, state: LoopState) -> str:
        if any(row not in state.tensors for row in state.values["rows"]):
            return "encode"
        if state.step < state.values["steps"]:
            return "denoise"
        return "decode" if "frames" not in state.tensors else "done"

    def next(self, state: LoopState) -> WorkPlan | Done:
        inst, phase = self.instance, self._phase(state)
        precision = str(inst.dtype).removeprefix("torch.")
        if phase == "encode":
            row = next(r for r in state.values["rows"] if r not in state.tensors)
            ids = state.tensors[f"ids.{row}"]
            return WorkPlan(
                kind=WorkUnitKind.ENCODER_CHUNK,
                body=partial(encode_body, pinned_module(inst, state, "text_encoder")),
                inputs={"input_ids": ids},
                batch_key=batch_key(inst, state, "text_encoder", "encode", (ids.shape[1],), precision),
                label=f"encode {'negative ' if row == 'neg_text' else ''}prompt",
            )
        if phase == "denoise":
            return self._denoise_plan(state, precision)
        if phase == "decode":
            latents, size = state.tensors["latents"], state.values["size"]
            return WorkPlan(
                kind=WorkUnitKind.VAE_TILE,
                body=partial(decode_body, pinned_module(inst, state, "vae")),
                inputs={"latents": latents, "size": size},
                batch_key=batch_key(inst, state, "vae", "vae_decode", (*latents.shape[1:], *size), precision),
                label="vae decode",
            )
        return Done()

    def _denoise_plan(self, state: LoopState, precision: str) -> WorkPlan:
        inst, t, v = self.instance, state.tensors, state.values
        i = state.step
        timestep = (t["timesteps"][i : i + 1] / 1000).to(inst.device, inst.dtype)
        image, grid = self._image_stream(state)
        inputs: dict[str, Any] = {
            "latents": image,
            "timestep": timestep,
            "grid": grid,
            BLOCKS_INPUT: None,  # block-structured body: the runner may attach a block hook here
        }
        for row in v["rows"]:  # prompts of other lengths batch zero-padded, each row masked to its own
            inputs[row], inputs[f"{row}_len"] = t[row], torch.tensor([t[row].shape[1]])
        kernel = self._packed_kernel(state)
        packed = {name: 1 for name in ("latents", *v["rows"])} | {"grid": 0} if kernel is not None else {}
        shape = ("packed",) if packed else (image.shape[1], grid)  # packed: requests of any size share a step
        transformer = inst.component("transformer", pinned(state, "transformer"))
        return WorkPlan(
            kind=WorkUnitKind.DIFFUSION_STEP,
            body=partial(denoise_body, transformer, packed=kernel),
            # determinism: bitwise packs too where the kernel's segments are each exactly a request alone
            invariant_body=partial(denoise_body, transformer, packed=kernel, exact=True)
            if getattr(kernel, "row_exact", False)
            else None,
            inputs=inputs,
            batch_key=batch_key(
                inst, state, "transformer", "diffusion_denoise", (*shape, tuple(v["rows"])), precision
            ),
            ragged={} if packed else {row: 1 for row in v["rows"]},
            packed=packed,
            packed_outputs={out: "latents" for out in ("velocity", "cond", "uncond")} if packed else {},
            cost_s=self._cost(state),
            label=f"denoise {i + 1}/{v['steps']}",
        )

    def _image_stream(self, state: LoopState) -> tuple[torch.Tensor, Any]:
        """The transformer's image stream [1, tokens, C] and its grid: the noise latents alone here."""
        h, w = state.values["size"]
        return state.tensors["latents"], (1, h // 2, w // 2)

    def _packed_kernel(self, state: LoopState):
        """The deploy's packed_attention kernel when this request may be packed (requests with adapters
        are not: their adapters, pinned in ``state.values["adapters"]``, apply per batch row; nor edit-2511's
        reference tokens at timestep 0, which the packed block does not modulate), else None."""
        chosen = self.instance.kernels.get("packed_attention")
        zero_cond = self.instance.config("transformer/config.json").get("zero_cond_t")  # 2511: not packed
        return None if chosen is None or state.values.get("adapters") or zero_cond else chosen[0]

    def advance(self, state: LoopState, result: StepResult) -> LoopState:
        out, t, phase = result.outputs, state.tensors, self._phase(state)
        if phase == "encode":
            row = next(r for r in state.values["rows"] if r not in t)
            put_row(self.instance, state, row, out["embeds"])
        elif phase == "denoise":
            n = t["latents"].shape[1]  # the noise tokens' velocity (an edit's image stream goes on)
            velocity = (
                out["velocity"][:, :n]
                if "velocity" in out
                else true_cfg(out["cond"][:, :n], out["uncond"][:, :n], state.values["scale"])
            )
            i = state.step
            dt = t["sigmas"][i + 1] - t["sigmas"][i]  # float32, as the scheduler's step
            t["latents"] = (t["latents"].float() + dt * velocity).to(velocity.dtype)
            state.step += 1
        elif phase == "decode":
            t["frames"] = out["frames"][0]
        return state

    def finalize(self, state: LoopState) -> LoopResult:
        v = state.values
        metrics = {
            "steps": state.step,
            "text_cache_hits": v["cache_hits"],
            "cfg": "true_cfg" if v["cfg"] else "off",
            "kernels": self.instance.kernel_records(),
        }
        return LoopResult({"frames": state.tensors["frames"], "latents": state.tensors["latents"]}, metrics)

    def estimate(self, state: LoopState) -> tuple[float, int]:
        """Predicted seconds left (denoise steps only) and peak bytes."""
        return (state.values["steps"] - state.step) * self._cost(state), 0

    def _cost(self, state: LoopState) -> float:
        cost = self.instance.card.loops[state.loop_id].step_cost
        tokens = state.tensors["latents"].shape[1]
        return (2 if state.values["cfg"] else 1) * (cost.base_s + cost.per_token_s * tokens)
