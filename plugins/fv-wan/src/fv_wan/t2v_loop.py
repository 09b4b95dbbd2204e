"""The Wan loop, for every variant and task (``t2v``, ``t2i``, ``i2v``): encode -> [image] -> text K/V
-> denoise steps -> VAE decode.

Each phase is its own WorkUnit: ENCODER_CHUNK (UMT5, skipped on a feature
cache hit; CLIP for Wan2.1 I2V; then the transformer's per-block
cross-attention keys/values of the prompt, computed once per request and
expert instead of once per step), VAE_TILE (the image's latent, then the
decode) and DIFFUSION_STEP (one transformer call per step, or two under
two-forward CFG). The phase is whatever the request still lacks, in that
order (``_next_phase``). A request keeps its text keys/values folded (each
prompt row's positions up to its padding's repeated one, ``kv_rows``; a call
of one row unfolds them one block at a time, a call of several attends to the
folds: see ``transformer``), unless its steps run on a parallel group. Step
bodies (:mod:`fv_wan.bodies`) are pure functions of their inputs over shared
weights, so the runtime may batch equal-keyed plans of different requests; a
request runs on the weights it pinned at init, and a step's batch key names
its expert and their versions, so Wan2.2 A14B requests batch only with steps
on the same expert. CFG combine and the sampler update run per request in
``advance``; the sampler's history lives in ``LoopState``.

Batch invariance (``WorkPlan.invariant_body``, what ``determinism: bitwise`` batches through): the
prompt encode, the text keys/values (text-only) and the denoise steps (one forward per row: single or
two-forward CFG; SDPA attention, no adapters, one device, not packed) declare it where this device's
GEMM and attention are measured row-invariant at the step's shapes (``fv_wan.invariance``); the image
encodes and the VAE decode (convolutions that split by batch) run alone under bitwise.
"""

from __future__ import annotations

import math
import re
from functools import partial
from typing import Any

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
from fv_core.request import ImagePart, NoiseDraws
from fv_wan import conditioning
from fv_wan.bodies import decode_body, denoise_body, encode_body, text_kv_body
from fv_wan.invariance import denoise_rows_invariant, gemm_invariant
from fv_wan.model import WanModel
from fv_wan.parallel import parallel_denoise_body
from fv_wan.params import WanParams
from fv_wan.samplers import Schedule, make_sampler
from fv_wan.text_cache import cached_kv, clean_prompt, put_kv, set_embeds, text_keys
from fv_wan.variant import HIGH_NOISE


class WanLoop:
    """The Loop of Wan cards (tasks ``t2v``, ``t2i`` and ``i2v``), bound to one live WanModel. Holds no
    request state: every request's state is its LoopState."""

    def __init__(self, instance: WanModel) -> None:
        self.instance = instance
        self._samplers: dict[tuple, Any] = {}  # (loop id, sampler, flow shift) -> its stateless sampler

    def init(self, request, instance=None, ctx=None) -> LoopState:
        inst = self.instance
        if instance is not None and instance is not inst:
            raise ConfigError("a WanLoop runs requests on the instance it was made for. Fix: model.loop(...)")
        p = request.params
        inst.components_for(request.task)  # rejects tasks the card does not serve
        loop_id = inst.card.programs[request.task].stages[0]
        # the i2v loop's one image (prepare refuses images elsewhere, and an i2v request without one)
        image = next((part for part in request.parts if part.kind == "image"), None)
        state = pinned_state(request, inst, loop_id, total_steps=p.num_inference_steps)
        cfg = p.guidance_scale > 1.0  # as diffusers: the first expert's scale decides
        prompts = [clean_prompt(p.prompt)] + ([clean_prompt(p.negative_prompt)] if cfg else [])
        tok = inst.component("tokenizer")
        enc = tok(
            prompts,
            padding="max_length",
            max_length=p.max_sequence_length,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        state.tensors.update(input_ids=enc.input_ids, mask=enc.attention_mask)
        cached = [inst.feature_cache.get(k) for k in text_keys(inst, state)]
        second = p.guidance_scale if p.guidance_scale_2 is None else p.guidance_scale_2
        state.values.update(
            task=request.task,
            cfg=cfg,
            cfg_mode=p.cfg_mode,
            guidance=dict(zip(inst.variant.experts, (p.guidance_scale, second), strict=False)),
            sampler=p.sampler,
            flow_shift=p.flow_shift,
            steps=p.num_inference_steps,
            cache_hits=sum(c is not None for c in cached),
            kv_cache_hits=0,
            experts_run=[],
            size=[p.num_frames, p.height, p.width],
            prompt=p.prompt,
            negative_prompt=p.negative_prompt,
            # what a rollout's BehaviorRecord keeps besides each step's inputs and outputs
            conditioning=["text", "neg_text", "image_features", "condition"],
        )
        if all(c is not None for c in cached):
            set_embeds(state, torch.stack(cached))
        sched = self._sampler(state).schedule(p.num_inference_steps)
        state.tensors.update(timesteps=sched.timesteps, sigmas=sched.sigmas)
        v = inst.variant
        shape = (
            1,
            v.latent_channels,
            (p.num_frames - 1) // v.temporal_scale + 1,
            p.height // v.spatial_scale,
            p.width // v.spatial_scale,
        )
        latents = NoiseDraws(state.generator, p).randn(*shape)  # CPU generator, as diffusers
        state.tensors["latents"] = latents.to(inst.device)
        if v.conditioning == "first_frame":
            state.tensors["frame_mask"] = conditioning.first_frame_mask(shape, image is not None).to(
                inst.device
            )
        if image is not None:
            self._prepare_image(state, image, p)
        state.values["phase"] = self._next_phase(state)
        return state

    def next(self, state: LoopState) -> WorkPlan | Done:
        inst = self.instance
        phase, precision = state.values["phase"], str(inst.dtype).removeprefix("torch.")
        if phase == "encode":
            ids = state.tensors["input_ids"]
            encoder = pinned_module(inst, state, "text_encoder")
            body = partial(encode_body, encoder)
            width = encoder.config.d_model
            return WorkPlan(
                kind=WorkUnitKind.ENCODER_CHUNK,
                body=body,
                inputs={"input_ids": ids, "mask": state.tensors["mask"]},
                batch_key=batch_key(inst, state, "text_encoder", "encode", (ids.shape[1],), precision),
                batch_size=ids.shape[0],
                label="encode prompt",
                invariant_body=body if gemm_invariant(self.instance, ids.shape[1], width) else None,
            )
        if phase == "image_encode":
            unit = (WorkUnitKind.ENCODER_CHUNK, "image_encoder", conditioning.clip_body, "encode")
            return self._unit(state, *unit, {"pixels": state.tensors["clip_pixels"]}, "encode image (CLIP)")
        if phase == "condition":
            unit = (WorkUnitKind.VAE_TILE, "vae", conditioning.encode_condition_body, "vae_encode")
            return self._unit(state, *unit, {"video": state.tensors["condition_video"]}, "encode image (VAE)")
        if phase == "text_kv":
            return self._text_kv_plan(state, inst, precision)
        if phase == "denoise":
            return self._denoise_plan(state, inst, precision)
        if phase == "decode":
            unit = (WorkUnitKind.VAE_TILE, "vae", decode_body, "vae_decode")
            return self._unit(state, *unit, {"latents": state.tensors["latents"]}, "vae decode")
        return Done()

    def advance(self, state: LoopState, result: StepResult) -> LoopState:
        inst, t = self.instance, state.tensors
        out, phase = result.outputs, state.values["phase"]
        if phase == "encode":
            embeds = out["embeds"]
            for row, key in enumerate(text_keys(inst, state)):
                inst.feature_cache.put(key, embeds[row])
            set_embeds(state, embeds)
        elif phase == "image_encode":
            t["image_features"] = out["features"]
            del t["clip_pixels"]
        elif phase == "condition":
            latents = out["latents"]
            if inst.variant.conditioning == "concat":
                latents = conditioning.concat_condition(latents, inst.variant.temporal_scale)
            t["condition"] = latents
            del t["condition_video"]
        elif phase == "text_kv":
            expert, kv, held = state.values["kv_for"], out["kv"], out.get("kv_rows")
            if "image_features" not in t:  # text-only keys/values are shared by every request
                put_kv(inst, state, expert, kv, held)
            t[f"kv.{expert}"] = kv  # rows: cond[, uncond]
            if held is not None:
                t[f"kv_rows.{expert}"] = held
            if "img_kv" in out:
                t[f"img_kv.{expert}"] = out["img_kv"]
        elif phase == "denoise":
            self._step(state, out)
        elif phase == "decode":
            t["frames"] = out["frames"][0]
        state.values["phase"] = self._next_phase(state)
        return state

    def finalize(self, state: LoopState) -> LoopResult:
        v = state.values
        metrics = {
            "steps": state.step,
            "text_cache_hits": v["cache_hits"],
            "kv_cache_hits": v["kv_cache_hits"],
            "sampler": v.get("sampler"),
            "cfg": v["cfg_mode"] if v["cfg"] else "off",
            "kernels": self.instance.kernel_records(state.tensors.get("latents")),
        }
        if len(self.instance.variant.experts) > 1:
            metrics["experts"] = v["experts_run"]  # the expert of each step
        return LoopResult({"frames": state.tensors["frames"], "latents": state.tensors["latents"]}, metrics)

    def estimate(self, state: LoopState) -> tuple[float, int]:
        """Predicted seconds left (denoise steps only; encode and decode are small) and peak bytes."""
        inst = self.instance
        if "latents" not in state.tensors:
            return 0.0, 0
        left = state.values["steps"] - state.step
        return left * self._cost(inst, state, state.tensors["latents"]), 0

    # ---- helpers ----

    def _unit(
        self,
        state: LoopState,
        kind,
        component: str,
        body,
        op: str,
        inputs: dict[str, torch.Tensor],
        label: str,
    ) -> WorkPlan:
        """A one-row plan of ``body`` over ``component``, batchable with plans of the same input shape."""
        inst, (tensor,) = self.instance, inputs.values()
        return WorkPlan(
            kind=kind,
            body=partial(body, pinned_module(inst, state, component)),
            inputs=inputs,
            batch_key=batch_key(
                inst, state, component, op, tuple(tensor.shape[1:]), str(inst.dtype).removeprefix("torch.")
            ),
            label=label,
        )

    def _prepare_image(self, state: LoopState, image: ImagePart, p: WanParams) -> None:
        """What the image phases encode: the VAE's condition video and, for Wan2.1 I2V, CLIP's pixels."""
        from PIL import Image

        variant, pil = self.instance.variant, Image.fromarray(image.pixels())
        pixels = conditioning.vae_image(pil, variant, p.height, p.width)
        state.tensors["condition_video"] = conditioning.condition_video(pixels, variant, p.num_frames)
        if variant.image_encoder:
            processor = self.instance.component("image_processor")
            state.tensors["clip_pixels"] = processor(images=pil, return_tensors="pt").pixel_values

    def _next_phase(self, state: LoopState) -> str:
        """The first thing the request still lacks: text, image features, image latents, the step's
        expert's text keys/values, denoise steps, frames."""
        t, v = state.tensors, state.values
        if "text" not in t:
            return "encode"
        if "clip_pixels" in t:
            return "image_encode"
        if "condition_video" in t:
            return "condition"
        if state.step < v["steps"]:
            expert = self._expert(state, state.step)
            fold = self.instance.parallel is None
            if f"kv.{expert}" not in t and not cached_kv(self.instance, state, expert, fold):
                v.update(kv_for=expert, kv_fold=fold)
                return "text_kv"
            return "denoise"
        if "frames" not in t:
            return "decode"
        return "done"

    def _expert(self, state: LoopState, step: int) -> str:
        """The transformer that runs ``step``: Wan2.2 A14B's low-noise expert once the step's integer
        timestep falls below boundary_ratio x num_train_timesteps, else the (high-noise) transformer."""
        variant = self.instance.variant
        if variant.boundary_ratio is None:
            return HIGH_NOISE
        boundary = variant.boundary_ratio * self.instance.scheduler_config.get("num_train_timesteps", 1000)
        return HIGH_NOISE if state.tensors["timesteps"][step] >= boundary else variant.experts[1]

    def _text_kv_plan(self, state: LoopState, inst, precision: str) -> WorkPlan:
        expert, t = state.values["kv_for"], state.tensors
        text = torch.cat([t[k] for k in ("text", "neg_text") if k in t]).to(inst.dtype)
        fold = state.values.get("kv_fold", False)
        inputs: dict[str, Any] = {"text": text, "fold": fold}
        signature: tuple = (*text.shape[1:], fold)
        if "image_features" in t:  # the image rows follow the text rows: one per prompt row
            inputs["image"] = t["image_features"].to(inst.dtype).expand(text.shape[0], -1, -1)
            signature += tuple(inputs["image"].shape[1:])
        body = partial(text_kv_body, pinned_module(inst, state, expert))
        text_only = "image" not in inputs and gemm_invariant(self.instance, text.shape[1], text.shape[2])
        return WorkPlan(
            kind=WorkUnitKind.ENCODER_CHUNK,
            body=body,
            invariant_body=body if text_only else None,
            inputs=inputs,
            batch_key=batch_key(inst, state, expert, "encode", signature, precision),
            batch_size=text.shape[0],
            label=f"text keys/values ({expert})",
        )

    def _model_input(self, state: LoopState, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The transformer's input latents and timestep ``t`` [1] (or per token [1, tokens])."""
        variant, tensors = self.instance.variant, state.tensors
        latents = tensors["latents"]
        if variant.conditioning == "concat":
            return torch.cat([latents, tensors["condition"]], dim=1), t
        if variant.conditioning == "first_frame":
            mask = tensors["frame_mask"]
            if "condition" in tensors:
                latents = conditioning.with_image_frame(latents, tensors["condition"], mask)
            _, p_h, p_w = variant.patch
            return latents, (mask[0, 0][:, ::p_h, ::p_w] * t).flatten().unsqueeze(0)
        return latents, t

    def _denoise_plan(self, state: LoopState, inst, precision: str) -> WorkPlan:
        i, v, dtype = state.step, state.values, inst.dtype
        expert = self._expert(state, i)
        kv, img_kv = state.tensors[f"kv.{expert}"], state.tensors.get(f"img_kv.{expert}")
        kv_rows = state.tensors.get(f"kv_rows.{expert}")
        t = state.tensors["timesteps"][i : i + 1].to(state.tensors["latents"].device)
        latents, timestep = self._model_input(state, t)
        latents = latents.to(dtype)
        mode = v["cfg_mode"] if v["cfg"] else "single"
        if mode == "batched":
            inputs = {
                "latents": torch.cat([latents, latents]),
                "timestep": torch.cat([timestep, timestep]),
                "kv": kv,
                "batched_cfg": True,  # rows [cond, uncond]: a cfg-parallel group splits them
            }
            if img_kv is not None:
                inputs["img_kv"] = img_kv
        else:
            inputs = {"latents": latents, "timestep": timestep, "kv": kv[:1]}
            if img_kv is not None:
                inputs["img_kv"] = img_kv[:1]
            if mode == "two_forward":
                inputs["neg_kv"] = kv[1:]
        kv_sig: tuple = tuple(kv.shape[1:])
        ragged = {}
        if kv_rows is not None:  # folded: batches with other folds of any length, zero-padded to the longest
            length = state.tensors["input_ids"].shape[1]
            ragged = {name: 3 for name in ("kv", "neg_kv") if name in inputs}
            rows = {"kv": kv_rows if mode == "batched" else kv_rows[:1], "neg_kv": kv_rows[1:]}
            inputs.update({name + "_rows": rows[name] for name in ragged})
            inputs["kv_length"] = length
            kv_sig = (*kv.shape[1:3], kv.shape[4], length)
        inputs[BLOCKS_INPUT] = None  # block-structured body: the runner may attach a block hook here
        suffix = "" if expert == HIGH_NOISE else f"@{expert}"
        if suffix:
            inputs["branch_suffix"] = suffix  # equal across a batch: the batch key names the expert
        shape_sig = (
            tuple(latents.shape[1:]),
            kv_sig,
            None if img_kv is None else tuple(img_kv.shape[1:]),
            tuple(timestep.shape[1:]),
            str(timestep.dtype),
        )
        group = inst.parallel
        kernel = self._packed_kernel(state, mode, img_kv, timestep)
        packed: dict[str, int] = {}
        if kernel is not None:  # requests of any size and frame count share the step (fv_wan.packed)
            inputs["latents"], inputs["shape"] = latents.flatten(2), tuple(latents.shape[2:])
            packed = {"latents": 2, "shape": 0} | {n: 3 for n in ("kv", "neg_kv") if n in inputs}
            if "kv_length" in inputs:  # folded prompts: each request's own full length
                packed["kv_length"] = 0
            shape_sig = ("packed", latents.shape[1], tuple(kv_sig[:2]), str(timestep.dtype))
            ragged = {}
        invariant = None
        if mode != "batched" and kernel is None and group is None and not state.values.get("adapters"):
            keys = (inputs.get("kv_length") or kv.shape[3],) + (() if img_kv is None else (img_kv.shape[3],))
            if denoise_rows_invariant(inst, expert, timestep, latents, keys):
                invariant = self._denoise_body(expert, pinned(state, expert), invariant=True)
        return WorkPlan(
            kind=WorkUnitKind.DIFFUSION_STEP,
            body=self._denoise_body(expert, pinned(state, expert), kernel),
            invariant_body=invariant,
            inputs=inputs,
            batch_key=batch_key(
                inst,
                state,
                expert,
                "diffusion_denoise",
                shape_sig,
                precision,
                parallel_plan=group.plan.id if group is not None else "single",
                graph_key=mode,
            ),
            batch_size=inputs["latents"].shape[0],
            cost_s=self._cost(inst, state, latents),
            ragged=ragged,
            packed=packed,
            packed_outputs={out: "latents" for out in ("velocity", "cond", "uncond")} if packed else {},
            label=f"denoise {i + 1}/{v['steps']}" + (f" ({expert})" if suffix else ""),
        )

    def _packed_kernel(self, state: LoopState, mode: str, img_kv, timestep: torch.Tensor):
        """The deploy's packed_attention kernel when this step may be packed: one row per forward (no
        batched CFG), text-only cross-attention, one timestep per request, one device, no adapters
        (they apply per batch row, ``state.values["adapters"]``); else None."""
        chosen = (self.instance.kernels or {}).get("packed_attention")
        plain = mode != "batched" and img_kv is None and timestep.ndim == 1 and self.instance.parallel is None
        return chosen[0] if chosen is not None and plain and not state.values.get("adapters") else None

    def _denoise_body(self, expert: str, version: str | None = None, packed=None, invariant: bool = False):
        """The denoise step body of ``expert`` (at weights ``version``; None: the live one): on the
        instance's parallel group when it has one; ``packed``: the packed_attention kernel;
        ``invariant``: its batch-invariant form."""
        group = self.instance.parallel
        if group is not None:
            return partial(parallel_denoise_body, group, expert)
        module = self.instance.component(expert, version)
        return partial(denoise_body, module, packed=packed, invariant=invariant)

    def replay_plan(self, record: Any, step: Any) -> WorkPlan:
        """A recorded step (``record.steps[i]``) as a plan on this instance's live weights: its body
        over the recorded inputs (``fv_core.training.replay_step``)."""
        inputs = dict(step.inputs)
        if step.kind == WorkUnitKind.DIFFUSION_STEP.value:
            expert = inputs.get("branch_suffix", "@" + HIGH_NOISE)[1:]
            inputs[BLOCKS_INPUT] = None
            body = self._denoise_body(expert)
        else:
            units = {
                "encode prompt": (encode_body, "text_encoder"),
                "encode image (CLIP)": (conditioning.clip_body, "image_encoder"),
                "encode image (VAE)": (conditioning.encode_condition_body, "vae"),
                "vae decode": (decode_body, "vae"),
            }
            kv = re.fullmatch(r"text keys/values \((.+)\)", step.label)
            if kv is None and step.label not in units:
                raise ConfigError(f"a Wan loop has no step labelled {step.label!r} to replay")
            fn, component = (text_kv_body, kv.group(1)) if kv else units[step.label]
            body = partial(fn, self.instance.component(component))
        rows = next(x.shape[0] for x in inputs.values() if isinstance(x, torch.Tensor))
        return WorkPlan(WorkUnitKind(step.kind), body, inputs, batch_size=rows, label=step.label)

    def _step(self, state: LoopState, out: dict[str, Any]) -> None:
        """CFG combine with the step's expert's guidance, then the sampler update."""
        values, tensors = state.values, state.tensors
        expert = self._expert(state, state.step)
        guidance = values["guidance"][expert]
        shape = tensors["latents"].shape  # a packed step's velocities come flattened [1, C, F H W]
        out = {
            k: v.view(shape) if isinstance(v, torch.Tensor) and v.dim() == 3 else v for k, v in out.items()
        }
        if "cond" in out:  # two-forward CFG
            velocity = out["uncond"] + guidance * (out["cond"] - out["uncond"])
        elif values["cfg"]:  # batched CFG: rows are [cond, uncond]
            cond, uncond = out["velocity"].chunk(2)
            velocity = uncond + guidance * (cond - uncond)
        else:
            velocity = out["velocity"]
        sampler = self._sampler(state)
        sched = Schedule(tensors["timesteps"], tensors["sigmas"])
        tensors["latents"] = sampler.step(
            tensors, values, sched, state.step, velocity, tensors["latents"], state.generator
        )
        values["experts_run"].append(expert)
        state.step += 1
        if state.step == values["steps"] and "condition" in tensors and "frame_mask" in tensors:
            # first_frame: the image's frame goes back in, as diffusers' TI2V does
            tensors["latents"] = conditioning.with_image_frame(
                tensors["latents"], tensors["condition"], tensors["frame_mask"]
            )

    @staticmethod
    def _cost(inst, state: LoopState, latents: torch.Tensor) -> float:
        cost = inst.card.loops[state.loop_id].step_cost
        tokens = math.prod(latents.shape[2:]) // 4  # 1x2x2 patches
        forwards = 2 if state.values["cfg"] else 1
        return forwards * (cost.base_s + cost.per_token_s * tokens)

    def _sampler(self, state: LoopState):
        """The request's sampler: stateless, so made once per loop id, sampler and flow shift."""
        key = (state.loop_id, state.values["sampler"], state.values["flow_shift"])
        if key not in self._samplers:
            inst = self.instance
            fixed = inst.card.loops[state.loop_id].steps.fixed_timesteps
            config = {**inst.scheduler_config, "flow_shift": key[2]}
            self._samplers[key] = make_sampler(key[1], config, fixed)
        return self._samplers[key]
