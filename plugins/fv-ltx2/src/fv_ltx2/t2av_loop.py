"""The LTX-2 loop (task ``t2av``): encode -> prompt keys/values -> (guidance branches -> combine +
Euler)* -> decode video -> decode audio.

The prompt's keys/values of every block's text cross-attention (video and audio) are computed once
per request (:mod:`fv_ltx2.prompt_kv`, cached per prompt row like the text features, with the
transformer's version and adapters) and every branch call of every step takes them instead of the text.

One transformer call returns the video and the audio velocity. Guidance is a policy of up to three
branches per step, each its own WorkUnit the scheduler may batch with the same branch of other
requests: ``cfg`` (rows [uncond, cond]; ``cond`` alone when CFG is off), ``stg`` (the cond row with
self-attention perturbed in the configured blocks) and ``modality`` (the cond row without
audio<->video cross-attention). Branches whose scales make them a no-op are not run, nor is ``stg``
on a transformer without perturbed attention (its call would be the cond call: the cond row's
velocity stands in for it, as the same bits). The branch
outputs are combined in x0 space with per-modality scales and rescale, as diffusers' LTX2Pipeline
combines them, then both latents take one flow-match Euler step on the schedule LTX-2's scheduler
config gives (dynamic shift from the video token count; float sigmas when the request gives them).

A request pins its components' weights versions at init (``fv_core.loop.pinned_state``; a program's
later stages keep the first stage's) and runs on those modules to the end, whatever weight sync lands
meanwhile; the versions are part of its batch keys and text cache keys.
"""

from __future__ import annotations

import re
from functools import partial
from typing import Any

import torch

from fv_core import ConfigError
from fv_core.adapters import adapter_tag
from fv_core.cache import CacheKey
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
from fv_ltx2.model import LTX2Model
from fv_ltx2.parallel import parallel_denoise_body
from fv_ltx2.prompt_kv import cacheable, cached_prompt_kv, prompt_kv_plan, put_prompt_kv
from fv_ltx2.steps import (
    decode_audio_body,
    decode_video_body,
    denoise_body,
    encode_body,
    guided_x0,
    noise_draws,
    pack,
    schedule,
    unpack,
)


class LTX2Loop:
    """The loop of LTX-2 cards (task ``t2av``), bound to one live LTX2Model; all request state is in
    LoopState. A request whose ``carry`` asks for ``latents_out`` (a program's base stage) ends after
    denoising with its latents, and where its noise streams stand, instead of decoding them."""

    loop_id = "t2av"  # the card's LoopSpec this class implements
    block_seam = True  # a block interceptor may drive this loop's transformer calls
    prompt_kv = True  # the prompt's keys/values are computed once per request (fv_ltx2.prompt_kv)
    schedule_overrides: dict[str, Any] = {}  # scheduler config values this loop replaces

    def __init__(self, instance: LTX2Model) -> None:
        self.instance = instance

    # ---- init: tokens, noise, schedule, positions ----

    def init(self, request, instance=None, ctx=None) -> LoopState:
        inst, p = self.instance, request.params
        state = pinned_state(request, inst, self.loop_id, total_steps=p.num_inference_steps)
        audio_vae, transformer = self._module(state, "audio_vae"), self._module(state, "transformer")
        grid, audio_frames = self._sizes(request)
        mel = audio_vae.config.mel_bins // audio_vae.mel_compression_ratio
        scales = p.audio_scales
        # without perturbed attention the STG call is the cond call (diffusers' STG pass is an ordinary
        # forward): the cond row's velocity stands in for it, and the call is not made
        stg_call = p.stg_on and bool(transformer.config.perturbed_attn)
        branches = (["cfg"] if p.cfg_on else ["cond"]) + ["stg"] * stg_call + ["modality"] * p.modality_on
        state.values.update(
            phase="encode", branch=0, branches=branches, grid=list(grid), audio_frames=audio_frames, mel=mel,
            guidance={"video": [p.guidance_scale, p.stg_scale, p.modality_scale, p.guidance_rescale],
                      "audio": list(scales)},
            statics=dict(
                num_frames=grid[0], height=grid[1], width=grid[2], fps=p.fps, audio_num_frames=audio_frames,
                use_cross_timestep=p.use_cross_timestep,
            ),
            stg_blocks=list(p.spatio_temporal_guidance_blocks), cache_hits=0, kv_cache_hits=0,
            stg_from_cond=p.stg_on and not stg_call,
            latents_out=bool(request.carry.get("latents_out")),
            # what a rollout's BehaviorRecord keeps besides each step's inputs, outputs and weights_versions
            conditioning=["video_text", "audio_text", "text_mask"],
        )  # fmt: skip
        self._tokenize(inst, state, p)
        self._start_latents(state, request, grid, audio_frames)
        config = {**inst.scheduler_config, **self.schedule_overrides}
        steps, sigmas = schedule(config, state.tensors["latents"].shape[1], p.num_inference_steps, p.sigmas)
        state.tensors.update(timesteps=steps, sigmas=sigmas)
        state.tensors["video_coords"] = transformer.rope.prepare_video_coords(
            1, *grid, inst.device, fps=p.fps
        )
        state.tensors["audio_coords"] = transformer.audio_rope.prepare_audio_coords(
            1, audio_frames, inst.device
        )
        state.values["decode_timestep"] = p.decode_timestep
        state.tensors.update({k: v.to(inst.device) for k, v in state.tensors.items()})
        return state

    def _start_latents(self, state: LoopState, request, grid: tuple[int, ...], audio_frames: int) -> None:
        """Packed noise for the video and audio latents (the generator's first draws, as diffusers')."""
        draws = noise_draws(state, request)
        vae, audio_vae, transformer = (self._module(state, n) for n in ("vae", "audio_vae", "transformer"))
        noise = draws.randn(1, vae.config.latent_channels, *grid)
        audio = draws.randn(1, audio_vae.config.latent_channels, audio_frames, state.values["mel"])
        patch, patch_t = transformer.config.patch_size, transformer.config.patch_size_t
        state.tensors.update(
            latents=pack(noise, patch, patch_t), audio_latents=audio.transpose(1, 2).flatten(2, 3)
        )
        self._end_draws(state, draws, vae, grid)

    def _end_draws(self, state: LoopState, draws, vae, grid: tuple[int, ...]) -> None:
        """After the latents' noise: the decode noise (diffusers' next draw, for VAEs with timestep
        conditioning), or, for a stage that hands on its latents, where its streams stand (the program's
        next stage continues them)."""
        if state.values["latents_out"]:
            state.values["rng"] = draws.state()
        elif vae.config.timestep_conditioning:
            state.tensors["decode_noise"] = draws.randn(1, vae.config.latent_channels, *grid)

    def _sizes(self, request) -> tuple[tuple[int, int, int], int]:
        """The latent grid (frames, height, width) and the audio latent length of the request, by the
        folder's VAE compression and audio sampling (as diffusers' LTX2Pipeline reads them)."""
        p, vae, audio_vae = (
            request.params,
            self.instance.component("vae"),
            self.instance.component("audio_vae"),
        )
        grid = (
            (p.num_frames - 1) // vae.temporal_compression_ratio + 1,
            p.height // vae.spatial_compression_ratio,
            p.width // vae.spatial_compression_ratio,
        )
        per_second = (
            audio_vae.config.sample_rate
            / audio_vae.config.mel_hop_length
            / audio_vae.temporal_compression_ratio
        )
        return grid, round(p.num_frames / p.fps * per_second)

    def _tokenize(self, inst: LTX2Model, state: LoopState, p) -> None:
        """Token ids of [negative, prompt] (CFG) or [prompt], left-padded; cached rows skip the encoder."""
        prompts = ([p.negative_prompt] if "cfg" in state.values["branches"] else []) + [p.prompt]
        tok = inst.component("tokenizer")
        enc = tok(
            [t.strip() for t in prompts],
            padding="max_length",
            max_length=p.max_sequence_length,
            truncation=True,
            add_special_tokens=True,
            return_tensors="pt",
            padding_side="left",
        )
        state.tensors.update(input_ids=enc.input_ids, mask=enc.attention_mask)
        cached = [inst.feature_cache.get(k) for k in self._keys(state)]
        state.values["cache_hits"] = sum(c is not None for c in cached)
        if all(c is not None for c in cached):
            self._set_text(state, *(torch.stack(list(t)) for t in zip(*cached, strict=True)))

    # ---- the driven loop ----

    def next(self, state: LoopState) -> WorkPlan | Done:
        inst, phase = self.instance, state.values["phase"]
        precision = str(inst.dtype).removeprefix("torch.")
        if phase == "encode":
            ids = state.tensors["input_ids"]
            return WorkPlan(
                kind=WorkUnitKind.ENCODER_CHUNK,
                body=partial(encode_body, *(self._module(state, n) for n in ("text_encoder", "connectors"))),
                inputs={"input_ids": ids, "mask": state.tensors["mask"]},
                batch_key=batch_key(
                    inst, state, ("text_encoder", "connectors"), "encode", (ids.shape[1],), precision
                ),
                batch_size=ids.shape[0],
                label="encode prompt",
            )
        if phase == "prompt_kv":
            return prompt_kv_plan(inst, state, self._module(state, "transformer"), precision)
        if phase == "denoise":
            return self._branch_plan(state, precision)
        if phase == "decode_video":
            return self._decode_video_plan(state, precision)
        if phase == "decode_audio":
            audio = state.tensors["audio_latents"]
            return WorkPlan(
                kind=WorkUnitKind.AUDIO_CHUNK,
                body=partial(decode_audio_body, *(self._module(state, n) for n in ("audio_vae", "vocoder"))),
                inputs={"audio_latents": audio, "latent_mel_bins": state.values["mel"]},
                batch_key=batch_key(
                    inst, state, ("audio_vae", "vocoder"), "audio_decode", tuple(audio.shape[1:]), precision
                ),
                label="audio decode",
            )
        return Done()

    def advance(self, state: LoopState, result: StepResult) -> LoopState:
        out, v = result.outputs, state.values
        if v["phase"] == "encode":
            for row, key in enumerate(self._keys(state)):
                self.instance.feature_cache.put(
                    key, (out["video_text"][row], out["audio_text"][row], out["text_mask"][row])
                )
            self._set_text(state, out["video_text"], out["audio_text"], out["text_mask"])
        elif v["phase"] == "prompt_kv":
            put_prompt_kv(self.instance, state, self._keys(state), out)
        elif v["phase"] == "denoise":
            branch = v["branches"][v["branch"]]
            state.tensors[f"{branch}.video"], state.tensors[f"{branch}.audio"] = out["video"], out["audio"]
            v["branch"] += 1
            if v["branch"] == len(v["branches"]):
                self._combine_and_step(state)
        elif v["phase"] == "decode_video":
            state.tensors["frames"] = out["frames"][0]
            v["phase"] = "decode_audio"
        elif v["phase"] == "decode_audio":
            state.tensors["audio"] = out["audio"][0]
            v["phase"] = "done"
        return state

    def finalize(self, state: LoopState) -> LoopResult:
        v = state.values
        metrics = {
            "steps": state.step,
            "text_cache_hits": v["cache_hits"],
            "kv_cache_hits": v["kv_cache_hits"],
            "branches": v["branches"],  # the calls of each step
            "stg_from_cond": v["stg_from_cond"],
            "kernels": {"attention": "sdpa"},
            **self._extra_metrics(state),
        }
        if v["latents_out"]:
            return LoopResult({**self._latents(state), "rng": v["rng"]}, metrics)
        vocoder = self.instance.component("vocoder")
        outputs = {
            "frames": state.tensors["frames"],
            "audio": state.tensors["audio"],
            "sample_rate": int(vocoder.config.output_sampling_rate),
            "fps": v["statics"]["fps"],
        }
        return LoopResult(outputs, metrics)

    def _extra_metrics(self, state: LoopState) -> dict[str, Any]:
        return {}

    def _latents(self, state: LoopState) -> dict[str, torch.Tensor]:
        """Denormalized video latents [1, C, F, H, W] and audio latents [1, C, L, mel], as diffusers'
        ``output_type="latent"`` hands them to the next stage."""
        t = state.tensors
        vae, audio_vae, transformer = (self._module(state, n) for n in ("vae", "audio_vae", "transformer"))
        video = unpack(
            t["latents"],
            *state.values["grid"],
            transformer.config.patch_size,
            transformer.config.patch_size_t,
        )
        shape = (1, -1, 1, 1, 1)
        std, mean = vae.latents_std.view(shape).to(video), vae.latents_mean.view(shape).to(video)
        audio = t["audio_latents"] * audio_vae.latents_std.to(video) + audio_vae.latents_mean.to(video)
        return {
            "latents": video * std / vae.config.scaling_factor + mean,
            "audio_latents": audio.unflatten(2, (-1, state.values["mel"])).transpose(1, 2),
        }

    def estimate(self, state: LoopState) -> tuple[float, int]:
        """Predicted seconds left (the branch calls of the remaining steps) and peak bytes."""
        left = (state.total_steps or 0) - state.step
        rows = sum(2 if branch == "cfg" else 1 for branch in state.values["branches"])
        return left * rows * self._cost(state), 0

    # ---- helpers ----

    def _set_text(
        self, state: LoopState, video: torch.Tensor, audio: torch.Tensor, mask: torch.Tensor
    ) -> None:
        state.tensors.update(video_text=video, audio_text=audio, text_mask=mask)
        state.values["phase"] = "denoise"
        if (
            self.prompt_kv
            and self.instance.parallel is None
            and cacheable(self._module(state, "transformer").config)
        ):
            if not cached_prompt_kv(self.instance, state, self._keys(state)):
                state.values["phase"] = "prompt_kv"

    def _keys(self, state: LoopState) -> list[CacheKey]:
        inst, ids, mask = self.instance, state.tensors["input_ids"], state.tensors["mask"]
        return [
            CacheKey.of(
                inst.card.model_id,
                "connectors",
                pinned(state, "connectors"),
                ids[i],
                mask[i],
                max_length=int(ids.shape[-1]),
                precision=str(inst.dtype),
                text_encoder_version=pinned(state, "text_encoder"),
                # the request's adapters on Gemma and on the connectors make other features
                adapters=(adapter_tag(state, "text_encoder"), adapter_tag(state, "connectors")),
            )
            for i in range(ids.shape[0])
        ]

    def _module(self, state: LoopState, component: str) -> Any:
        """``component`` on the weights the request pinned (a weight sync since leaves it on them)."""
        return pinned_module(self.instance, state, component)

    def _branch_plan(self, state: LoopState, precision: str) -> WorkPlan:
        """The transformer call of the step's next branch."""
        inst, v, t = self.instance, state.values, state.tensors
        branch = v["branches"][v["branch"]]
        rows = 2 if branch == "cfg" else 1
        text = slice(None) if branch == "cfg" else slice(-1, None)  # cfg: [uncond, cond]; else the cond row
        inputs = {
            "latents": t["latents"].repeat(rows, 1, 1).to(inst.dtype),
            "audio_latents": t["audio_latents"].repeat(rows, 1, 1).to(inst.dtype),
            "video_text": t["video_text"][text],
            "audio_text": t["audio_text"][text],
            "text_mask": t["text_mask"][text],
            **{k: t[k][text] for k in ("video_kv", "audio_kv") if k in t},  # the prompt's keys/values
            **self._timesteps(t, state.step, rows),
            # views of the request's positions (a parallel group sends them to its workers once)
            "video_coords": t["video_coords"].expand(rows, *t["video_coords"].shape[1:]),
            "audio_coords": t["audio_coords"].expand(rows, *t["audio_coords"].shape[1:]),
        }
        if self.block_seam:
            inputs[BLOCKS_INPUT] = None  # block-structured body: the runner may attach a block hook here
        statics = self._statics(v, branch)
        shapes = tuple(tuple(x.shape[1:]) for x in inputs.values() if x is not None)
        graph = f"{type(self).__name__}:{branch}:{sorted(statics.items(), key=str)}"
        body = self._denoise(statics, branch, pinned(state, "transformer"))
        parallel = isinstance(body, partial) and body.func is parallel_denoise_body
        return WorkPlan(
            kind=WorkUnitKind.DIFFUSION_STEP,
            body=body,
            inputs=inputs,
            batch_key=batch_key(
                inst,
                state,
                "transformer",
                "diffusion_denoise",
                shapes,
                precision,
                parallel_plan=inst.parallel.plan.id if parallel else "single",
                graph_key=graph,
            ),
            batch_size=rows,
            cost_s=self._cost(state) * rows,
            label=f"denoise {state.step + 1}/{state.total_steps} ({branch})",
        )

    @staticmethod
    def _statics(values: dict[str, Any], branch: str) -> dict[str, Any]:
        """The transformer's per-request keyword arguments for a call of ``branch``."""
        return {
            **values["statics"],
            "isolate_modalities": branch == "modality",
            "spatio_temporal_guidance_blocks": values["stg_blocks"] if branch == "stg" else None,
        }

    @staticmethod
    def _timesteps(t: dict[str, torch.Tensor], step: int, rows: int) -> dict[str, torch.Tensor]:
        """The step's timestep per row; with a conditioning mask, per video token (conditioned tokens at
        0) and the row's own for audio."""
        timestep = t["timesteps"][step].expand(rows)
        if "conditioning_mask" not in t:
            return {"timestep": timestep}
        return {"timestep": timestep.unsqueeze(-1) * (1 - t["conditioning_mask"]), "audio_timestep": timestep}

    def _denoise(self, statics: dict[str, Any], branch: str, version: str | None = None):
        """The step body of one branch call on ``version`` of the transformer (None: the live one): on the
        instance's parallel group when it has one (it takes no weight syncs)."""
        if self.instance.parallel is not None:
            return partial(parallel_denoise_body, self.instance.parallel, statics, branch)
        return partial(denoise_body, self.instance.component("transformer", version), statics, branch)

    def replay_plan(self, record: Any, step: Any) -> WorkPlan:
        """A recorded denoise branch call (``record.steps[i]``) as a plan on this instance's live weights:
        its body over the recorded inputs (``fv_core.training.replay_step``)."""
        label = re.fullmatch(r"denoise \d+/\d+ \((\w+)\)", step.label)
        if step.kind != WorkUnitKind.DIFFUSION_STEP.value or label is None:
            raise ConfigError(f"LTX-2 replays its denoise steps only; got step {step.label!r}")
        branch, inputs = label.group(1), dict(step.inputs)
        for computed in ("video_kv", "audio_kv"):  # made by the recorded weights: the live ones remake them
            inputs.pop(computed, None)
        if self.block_seam:
            inputs[BLOCKS_INPUT] = None
        rows = inputs["latents"].shape[0]
        body = self._denoise(self._statics(record.values, branch), branch)
        return WorkPlan(WorkUnitKind.DIFFUSION_STEP, body, inputs, batch_size=rows, label=step.label)

    def _combine_and_step(self, state: LoopState) -> None:
        """Combine the branches in x0 space per modality, then one Euler step of both latents."""
        t, v, i = state.tensors, state.values, state.step
        sigma, sigma_next = t["sigmas"][i], t["sigmas"][i + 1]
        for modality, key in (("video", "latents"), ("audio", "audio_latents")):
            sample = t[key]
            outputs = {branch: t[f"{branch}.{modality}"] for branch in v["branches"]}
            if v["stg_from_cond"]:
                outputs["stg"] = outputs["cfg"].chunk(2)[1] if "cfg" in outputs else outputs["cond"]
            velocity = (sample - guided_x0(sample, sigma, outputs, v["guidance"][modality])) / sigma
            stepped = (sample.to(torch.float32) + (sigma_next - sigma) * velocity).to(velocity.dtype)
            if key == "latents" and "conditioning_mask" in t:  # conditioned tokens (the first frame) stay
                stepped = torch.where(t["conditioning_mask"].bool().unsqueeze(-1), sample, stepped)
            t[key] = stepped
        for branch in v["branches"]:
            del t[f"{branch}.video"], t[f"{branch}.audio"]
        state.step += 1
        v["branch"] = 0
        if state.step == state.total_steps:
            v["phase"] = "done" if v["latents_out"] else "decode_video"

    def _decode_video_plan(self, state: LoopState, precision: str) -> WorkPlan:
        t = state.tensors
        vae, transformer = self._module(state, "vae"), self._module(state, "transformer")
        latents = unpack(
            t["latents"],
            *state.values["grid"],
            transformer.config.patch_size,
            transformer.config.patch_size_t,
        )
        inputs: dict[str, Any] = {"latents": latents}
        if "decode_noise" in t:  # VAEs with timestep conditioning decode slightly re-noised latents
            scale = state.values["decode_timestep"]
            inputs["latents"] = (1 - scale) * latents + scale * t["decode_noise"]
            inputs["timestep"] = torch.tensor([scale], dtype=latents.dtype)
        return WorkPlan(
            kind=WorkUnitKind.VAE_TILE,
            body=partial(decode_video_body, vae),
            inputs=inputs,
            batch_key=batch_key(
                self.instance, state, "vae", "vae_decode", tuple(latents.shape[1:]), precision
            ),
            label="video decode",
        )

    def _cost(self, state: LoopState) -> float:
        cost = self.instance.card.loops[state.loop_id].step_cost
        return cost.base_s + cost.per_token_s * state.tensors["latents"].shape[1]
