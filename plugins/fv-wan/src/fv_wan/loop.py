"""The Wan text-to-video loop: encode -> text K/V -> denoise steps -> VAE decode.

Each phase is its own WorkUnit: ENCODER_CHUNK (UMT5, skipped on a feature
cache hit; then the transformer's per-block cross-attention keys/values of
the prompt, computed once per request instead of once per step),
DIFFUSION_STEP (one transformer call per step, or two under two-forward CFG)
and VAE_TILE (decode). Step bodies are pure functions of
their inputs over shared weights, so the runtime may batch equal-keyed
plans of different requests. CFG combine and the sampler update run per
request in ``advance``; the sampler's history lives in ``LoopState``.
"""

from __future__ import annotations

import html
import re
from functools import partial
from typing import Any

import torch

from fv_core import (
    BatchKey,
    CacheKey,
    ConfigError,
    Done,
    LoopResult,
    LoopState,
    StepResult,
    WorkPlan,
    WorkUnitKind,
)
from fv_core.extend import BLOCKS_INPUT
from fv_wan.model import WanModel
from fv_wan.params import WanParams
from fv_wan.samplers import Schedule, make_sampler
from fv_wan.transformer import text_kv, wan_forward_kv


def clean_prompt(text: str) -> str:
    """The prompt normalisation Wan's pipeline applies (ftfy when installed, html unescape, spaces)."""
    try:
        import ftfy

        text = ftfy.fix_text(text)
    except ImportError:
        pass
    return re.sub(r"\s+", " ", html.unescape(html.unescape(text)).strip()).strip()


# ---- step bodies: pure functions of their inputs over shared weights ----


def encode_body(text_encoder, inputs: dict[str, Any]) -> dict[str, Any]:
    """UMT5 last hidden states, zeroed past each prompt's length (as Wan's pipeline does)."""
    mask = inputs["mask"].to(text_encoder.device)
    hidden = text_encoder(inputs["input_ids"].to(text_encoder.device), mask).last_hidden_state
    return {"embeds": torch.where(mask.bool().unsqueeze(-1), hidden, torch.zeros((), dtype=hidden.dtype))}


def denoise_body(transformer, inputs: dict[str, Any]) -> dict[str, Any]:
    """Flow velocity; with ``neg_kv`` present, one forward per CFG branch (two-forward CFG).

    ``inputs[BLOCKS_INPUT]``: the request's block hook when a block interceptor is on (else None).
    """
    latents, t, hook = inputs["latents"], inputs["timestep"], inputs.get(BLOCKS_INPUT)
    if "neg_kv" in inputs:
        return {
            "cond": wan_forward_kv(transformer, latents, t, inputs["kv"], hook=hook, branch="cond"),
            "uncond": wan_forward_kv(transformer, latents, t, inputs["neg_kv"], hook=hook, branch="uncond"),
        }
    return {"velocity": wan_forward_kv(transformer, latents, t, inputs["kv"], hook=hook)}


def text_kv_body(transformer, inputs: dict[str, Any]) -> dict[str, Any]:
    """Every block's cross-attention keys/values for the prompt embeddings (step-invariant)."""
    return {"kv": text_kv(transformer, inputs["text"])}


def decode_body(vae, inputs: dict[str, Any]) -> dict[str, Any]:
    """Un-normalise latents, VAE decode, map to frames [B, F, H, W, 3] in 0..1."""
    z = inputs["latents"].to(vae.dtype)
    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(shape).to(z)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(z)
    video = vae.decode(z / inv_std + mean, return_dict=False)[0]
    return {"frames": (video * 0.5 + 0.5).clamp(0, 1).permute(0, 2, 3, 4, 1).float()}


class WanLoop:
    """The Loop of Wan cards (tasks ``t2v`` and ``t2i``), bound to one live WanModel. Holds no request
    state: every request's state is its LoopState."""

    def __init__(self, instance: WanModel) -> None:
        self.instance = instance

    def init(self, request, instance=None, ctx=None) -> LoopState:
        inst = self.instance
        if instance is not None and instance is not inst:
            raise ConfigError("a WanLoop runs requests on the instance it was made for. Fix: model.loop(...)")
        p = request.params
        if not isinstance(p, WanParams):
            raise ConfigError(
                f"request {request.request_id!r} carries {type(p).__name__} params, not WanParams. "
                "Fix: build requests with LoadedModel.prepare (fv_core.load(...).prepare(...))."
            )
        inst.components_for(request.task)  # rejects tasks the card does not serve
        loop_id = inst.card.programs[request.task].stages[0]
        gen = torch.Generator(device="cpu").manual_seed(p.seed)
        state = LoopState(
            request_id=request.request_id, loop_id=loop_id, total_steps=p.num_inference_steps, generator=gen
        )
        cfg = p.guidance_scale > 1.0
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
        cached = [inst.feature_cache.get(k) for k in self._keys(inst, state)]
        state.values.update(
            task=request.task,
            cfg=cfg,
            cfg_mode=p.cfg_mode,
            guidance=p.guidance_scale,
            sampler=p.sampler,
            flow_shift=p.flow_shift,
            phase="encode",
            steps=p.num_inference_steps,
            cache_hits=sum(c is not None for c in cached),
            size=[p.num_frames, p.height, p.width],
            prompt=p.prompt,
            negative_prompt=p.negative_prompt,
        )
        if all(c is not None for c in cached):
            self._set_embeds(inst, state, torch.stack(cached))
        sched = self._sampler(inst, state).schedule(p.num_inference_steps)
        state.tensors.update(timesteps=sched.timesteps, sigmas=sched.sigmas)
        shape = (1, 16, (p.num_frames - 1) // 4 + 1, p.height // 8, p.width // 8)  # 16 ch, x4 time, x8 space
        latents = torch.randn(shape, generator=gen, dtype=torch.float32)  # CPU generator, as diffusers
        state.tensors["latents"] = latents.to(inst.device)
        return state

    def next(self, state: LoopState) -> WorkPlan | Done:
        inst = self.instance
        phase, precision = state.values["phase"], str(inst.dtype).removeprefix("torch.")
        if phase == "encode":
            ids = state.tensors["input_ids"]
            return WorkPlan(
                kind=WorkUnitKind.ENCODER_CHUNK,
                body=partial(encode_body, inst.component("text_encoder")),
                inputs={"input_ids": ids, "mask": state.tensors["mask"]},
                batch_key=BatchKey(f"{inst.instance_id}/text_encoder", "encode", (ids.shape[1],), precision),
                batch_size=ids.shape[0],
                label="encode prompt",
            )
        if phase == "text_kv":
            text = torch.cat([state.tensors[k] for k in ("text", "neg_text") if k in state.tensors]).to(
                inst.dtype
            )
            return WorkPlan(
                kind=WorkUnitKind.ENCODER_CHUNK,
                body=partial(text_kv_body, inst.component("transformer")),
                inputs={"text": text},
                batch_key=BatchKey(
                    f"{inst.instance_id}/transformer", "encode", tuple(text.shape[1:]), precision
                ),
                batch_size=text.shape[0],
                label="text keys/values",
            )
        if phase == "denoise":
            return self._denoise_plan(state, inst, precision)
        if phase == "decode":
            latents = state.tensors["latents"]
            return WorkPlan(
                kind=WorkUnitKind.VAE_TILE,
                body=partial(decode_body, inst.component("vae")),
                inputs={"latents": latents},
                batch_key=BatchKey(
                    f"{inst.instance_id}/vae", "vae_decode", tuple(latents.shape[1:]), precision
                ),
                label="vae decode",
            )
        return Done()

    def advance(self, state: LoopState, result: StepResult) -> LoopState:
        inst = self.instance
        out, phase = result.outputs, state.values["phase"]
        if phase == "encode":
            embeds = out["embeds"]
            for row, key in enumerate(self._keys(inst, state)):
                inst.feature_cache.put(key, embeds[row])
            self._set_embeds(inst, state, embeds)
        elif phase == "text_kv":
            for row, key in enumerate(self._kv_keys(inst, state)):
                inst.kv_cache.put(key, out["kv"][row])
            state.tensors["kv"] = out["kv"]  # rows: cond[, uncond]
            state.values["phase"] = "denoise"
        elif phase == "denoise":
            if "cond" in out:  # two-forward CFG
                velocity = out["uncond"] + state.values["guidance"] * (out["cond"] - out["uncond"])
            elif state.values["cfg"]:  # batched CFG: rows are [cond, uncond]
                cond, uncond = out["velocity"].chunk(2)
                velocity = uncond + state.values["guidance"] * (cond - uncond)
            else:
                velocity = out["velocity"]
            sampler = self._sampler(inst, state)
            sched = Schedule(state.tensors["timesteps"], state.tensors["sigmas"])
            state.tensors["latents"] = sampler.step(
                state.tensors,
                state.values,
                sched,
                state.step,
                velocity,
                state.tensors["latents"],
                state.generator,
            )
            state.step += 1
            if state.step == state.values["steps"]:
                state.values["phase"] = "decode"
        elif phase == "decode":
            state.tensors["frames"] = out["frames"][0]
            state.values["phase"] = "done"
        return state

    def finalize(self, state: LoopState) -> LoopResult:
        v = state.values
        metrics = {
            "steps": state.step,
            "text_cache_hits": v["cache_hits"],
            "kv_cache_hits": v.get("kv_cache_hits", 0),
            "sampler": v.get("sampler"),
            "cfg": v["cfg_mode"] if v["cfg"] else "off",
            "kernels": self.instance.kernel_records(state.tensors.get("latents")),
        }
        return LoopResult({"frames": state.tensors["frames"], "latents": state.tensors["latents"]}, metrics)

    def estimate(self, state: LoopState) -> tuple[float, int]:
        """Predicted seconds left (denoise steps only; encode and decode are small) and peak bytes."""
        inst = self.instance
        if "latents" not in state.tensors:
            return 0.0, 0
        left = state.values["steps"] - state.step
        return left * self._cost(inst, state, state.tensors["latents"]), 0

    # ---- helpers ----

    def _denoise_plan(self, state: LoopState, inst, precision: str) -> WorkPlan:
        i, v, dtype = state.step, state.values, inst.dtype
        latents, kv = state.tensors["latents"].to(dtype), state.tensors["kv"]
        t = state.tensors["timesteps"][i].to(latents.device)
        mode = v["cfg_mode"] if v["cfg"] else "single"
        if mode == "batched":
            inputs = {
                "latents": torch.cat([latents, latents]),
                "timestep": t.expand(2),
                "kv": kv,
            }
        else:
            inputs = {"latents": latents, "timestep": t.expand(1), "kv": kv[:1]}
            if mode == "two_forward":
                inputs["neg_kv"] = kv[1:]
        inputs[BLOCKS_INPUT] = None  # block-structured body: the runner may attach a block hook here
        shape_sig = (tuple(latents.shape[1:]), tuple(kv.shape[1:]), str(t.dtype))
        return WorkPlan(
            kind=WorkUnitKind.DIFFUSION_STEP,
            body=partial(denoise_body, inst.component("transformer")),
            inputs=inputs,
            batch_key=BatchKey(
                f"{inst.instance_id}/transformer", "diffusion_denoise", shape_sig, precision, graph_key=mode
            ),
            batch_size=inputs["latents"].shape[0],
            cost_s=self._cost(inst, state, latents),
            label=f"denoise {i + 1}/{v['steps']}",
        )

    @staticmethod
    def _cost(inst, state: LoopState, latents: torch.Tensor) -> float:
        cost = inst.card.loops[state.loop_id].step_cost
        tokens = latents[0, 0].numel() // 4  # 1x2x2 patches
        forwards = 2 if state.values["cfg"] else 1
        return forwards * (cost.base_s + cost.per_token_s * tokens)

    @staticmethod
    def _sampler(inst, state: LoopState):
        fixed = inst.card.loops[state.loop_id].steps.fixed_timesteps
        config = {**inst.scheduler_config, "flow_shift": state.values["flow_shift"]}
        return make_sampler(state.values["sampler"], config, fixed)

    def _keys(self, inst, state: LoopState) -> list[CacheKey]:
        ids, mask = state.tensors["input_ids"], state.tensors["mask"]
        return [self._key(inst, ids[i], mask[i]) for i in range(ids.shape[0])]

    @staticmethod
    def _key(instance, ids: torch.Tensor, mask: torch.Tensor) -> CacheKey:
        return CacheKey.of(
            instance.card.model_id,
            "text_encoder",
            instance.weights_versions["text_encoder"],
            ids,
            mask,
            max_length=int(ids.shape[-1]),
            precision=str(instance.dtype),
        )

    def _kv_keys(self, inst, state: LoopState) -> list[CacheKey]:
        te = inst.weights_versions["text_encoder"]
        return [
            CacheKey(
                k.model,
                "transformer",
                inst.weights_versions["transformer"],
                k.content_hash,
                tuple(sorted((*k.extra, ("text_encoder_version", te)))),
            )
            for k in self._keys(inst, state)
        ]

    def _set_embeds(self, inst, state: LoopState, embeds: torch.Tensor) -> None:
        """Store the prompt embeddings, then the text keys/values too if every row is cached."""
        state.tensors["text"] = embeds[:1]
        if embeds.shape[0] > 1:
            state.tensors["neg_text"] = embeds[1:2]
        kv = [inst.kv_cache.get(k) for k in self._kv_keys(inst, state)]
        state.values["kv_cache_hits"] = sum(t is not None for t in kv)
        if all(t is not None for t in kv):
            state.tensors["kv"] = torch.stack(kv)
        state.values["phase"] = "denoise" if "kv" in state.tensors else "text_kv"
