"""The LTX-2 loop: encode -> (guidance branches -> combine + Euler)* -> decode video -> decode audio.

One transformer call returns the video and the audio velocity. Guidance is a policy of up to three
branches per step, each its own WorkUnit the scheduler may batch with the same branch of other
requests: ``cfg`` (rows [uncond, cond]; ``cond`` alone when CFG is off), ``stg`` (the cond row with
self-attention perturbed in the configured blocks) and ``modality`` (the cond row without
audio<->video cross-attention). Branches whose scales make them a no-op are not run. The branch
outputs are combined in x0 space with per-modality scales and rescale, as diffusers' LTX2Pipeline
combines them, then both latents take one flow-match Euler step on the schedule LTX-2's scheduler
config gives (dynamic shift from the video token count; float sigmas when the request gives them).

A request pins its components' weights versions at init (a program's later stages keep the first
stage's) and runs on those modules to the end, whatever weight sync lands meanwhile; the versions are
part of its batch keys and text cache keys.
"""

from __future__ import annotations

import re
from functools import partial
from typing import Any

import numpy as np
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
from fv_core.request import ImagePart, NoiseDraws
from fv_ltx2.model import LTX2Model
from fv_ltx2.parallel import parallel_denoise_body
from fv_ltx2.params import LTX2Params
from fv_ltx2.transformer import forward_blocks

# ---- step bodies: pure functions of their inputs over shared weights ----


def encode_body(text_encoder, connectors, inputs: dict[str, Any]) -> dict[str, Any]:
    """Gemma's stacked hidden states of every layer, through the connectors (rows independent)."""
    mask = inputs["mask"]
    out = text_encoder(input_ids=inputs["input_ids"], attention_mask=mask, output_hidden_states=True)
    hidden = torch.stack(out.hidden_states, dim=-1).flatten(2, 3).to(text_encoder.dtype)
    video, audio, text_mask = connectors(hidden, mask, padding_side="left")
    return {"video_text": video, "audio_text": audio, "text_mask": text_mask}


def denoise_body(transformer, statics: dict[str, Any], branch: str, inputs: dict[str, Any]) -> dict[str, Any]:
    """One transformer call: the video and audio velocities of every row. With a block hook in
    ``inputs[BLOCKS_INPUT]`` (a block interceptor is on) the blocks are driven one by one through it."""
    hook = inputs.get(BLOCKS_INPUT)
    if hook is not None:
        video, audio = forward_blocks(transformer, hook, branch, inputs, statics)
        return {"video": video.float(), "audio": audio.float()}
    video, audio = transformer(**_call(inputs, statics))
    return {"video": video.float(), "audio": audio.float()}


def lora_denoise_body(
    transformer,
    weights: dict[str, torch.Tensor],
    statics: dict[str, Any],
    branch: str,
    inputs: dict[str, Any],
) -> dict[str, Any]:
    """:func:`denoise_body` on the transformer with ``weights`` (LoRA-merged) in place of its own for this
    call only (``torch.func.functional_call`` swaps them in and back; bodies run on the engine's one
    worker thread, so no other call sees them)."""
    video, audio = torch.func.functional_call(
        transformer, weights, args=(), kwargs=_call(inputs, statics), strict=False
    )
    return {"video": video.float(), "audio": audio.float()}


def _call(inputs: dict[str, Any], statics: dict[str, Any]) -> dict[str, Any]:
    """The transformer's keyword arguments for a plan's inputs."""
    return dict(
        hidden_states=inputs["latents"],
        audio_hidden_states=inputs["audio_latents"],
        encoder_hidden_states=inputs["video_text"],
        audio_encoder_hidden_states=inputs["audio_text"],
        timestep=inputs["timestep"],
        audio_timestep=inputs.get("audio_timestep"),
        sigma=inputs.get("audio_timestep", inputs["timestep"]),
        encoder_attention_mask=inputs["text_mask"],
        audio_encoder_attention_mask=inputs["text_mask"],
        video_coords=inputs["video_coords"],
        audio_coords=inputs["audio_coords"],
        return_dict=False,
        **statics,
    )


def decode_video_body(vae, inputs: dict[str, Any]) -> dict[str, Any]:
    """Denormalize latents [B, C, F, H, W], VAE decode, frames [B, F, H, W, 3] in 0..1."""
    z = inputs["latents"].to(vae.dtype)
    shape = (1, -1, 1, 1, 1)
    z = z * vae.latents_std.view(shape).to(z) / vae.config.scaling_factor + vae.latents_mean.view(shape).to(z)
    video = vae.decode(z, inputs.get("timestep"), return_dict=False)[0]
    return {"frames": (video * 0.5 + 0.5).clamp(0, 1).permute(0, 2, 3, 4, 1).float()}


def decode_audio_body(audio_vae, vocoder, inputs: dict[str, Any]) -> dict[str, Any]:
    """Denormalize packed audio latents, unpack to [B, C, L, mel], audio VAE -> mel -> vocoder waveform."""
    z = inputs["audio_latents"]
    z = z * audio_vae.latents_std.to(z) + audio_vae.latents_mean.to(z)
    z = z.unflatten(2, (-1, inputs["latent_mel_bins"])).transpose(1, 2).to(audio_vae.dtype)
    mel = audio_vae.decode(z, return_dict=False)[0]
    return {"audio": vocoder(mel).float()}


def rescale(guided: torch.Tensor, cond: torch.Tensor, factor: float) -> torch.Tensor:
    """Guidance rescale: match the guided prediction's std to the conditional one's, mixed by ``factor``."""
    dims = list(range(1, cond.ndim))
    rescaled = guided * (cond.std(dim=dims, keepdim=True) / guided.std(dim=dims, keepdim=True))
    return factor * rescaled + (1 - factor) * guided


def pack(latents: torch.Tensor, patch: int, patch_t: int) -> torch.Tensor:
    """[B, C, F, H, W] -> tokens [B, F/pt * H/p * W/p, C * pt * p * p]."""
    b, _, f, h, w = latents.shape
    x = latents.reshape(b, -1, f // patch_t, patch_t, h // patch, patch, w // patch, patch)
    return x.permute(0, 2, 4, 6, 1, 3, 5, 7).flatten(4, 7).flatten(1, 3)


def unpack(tokens: torch.Tensor, f: int, h: int, w: int, patch: int, patch_t: int) -> torch.Tensor:
    """The inverse of :func:`pack`."""
    x = tokens.reshape(tokens.size(0), f, h, w, -1, patch_t, patch, patch)
    return x.permute(0, 4, 1, 5, 2, 6, 3, 7).flatten(6, 7).flatten(4, 5).flatten(2, 3)


def schedule(config: dict[str, Any], video_tokens: int, steps: int, sigmas: list[float] | None):
    """(timesteps, sigmas + the final 0) of LTX-2's scheduler for this many video tokens."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift

    scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)  # computes the schedule; not stepped
    mu = calculate_shift(
        video_tokens,
        config.get("base_image_seq_len", 1024),
        config.get("max_image_seq_len", 4096),
        config.get("base_shift", 0.95),
        config.get("max_shift", 2.05),
    )
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps) if sigmas is None else sigmas, mu=mu)
    return scheduler.timesteps, scheduler.sigmas


class LTX2Loop:
    """The loop of LTX-2 cards (task ``t2av``), bound to one live LTX2Model; all request state is in
    LoopState. A request whose ``carry`` asks for ``latents_out`` (a program's base stage) ends after
    denoising with its latents instead of decoding them."""

    loop_id = "t2av"  # the card's LoopSpec this class implements
    block_seam = True  # a block interceptor may drive this loop's transformer calls
    schedule_overrides: dict[str, Any] = {}  # scheduler config values this loop replaces

    def __init__(self, instance: LTX2Model) -> None:
        self.instance = instance

    # ---- init: tokens, noise, schedule, positions ----

    def init(self, request, instance=None, ctx=None) -> LoopState:
        inst, p = self.instance, request.params
        if not isinstance(p, LTX2Params):
            raise ConfigError(
                f"request {request.request_id!r} carries {type(p).__name__} params, not LTX2Params. "
                "Fix: build requests with LoadedModel.prepare (fv_core.load(...).prepare(...))."
            )
        gen = torch.Generator(device="cpu").manual_seed(p.seed)  # CPU noise, as diffusers draws it
        state = LoopState(request.request_id, self.loop_id, total_steps=p.num_inference_steps, generator=gen)
        # the weights it runs on to the end (a program's later stages: those its first stage pinned)
        state.values["weights_versions"] = dict(
            request.carry.get("weights_versions") or inst.weights_versions
        )
        audio_vae, transformer = self._module(state, "audio_vae"), self._module(state, "transformer")
        grid, audio_frames = self._sizes(request)
        mel = audio_vae.config.mel_bins // audio_vae.mel_compression_ratio
        scales = p.audio_scales
        branches = (["cfg"] if p.cfg_on else ["cond"]) + ["stg"] * p.stg_on + ["modality"] * p.modality_on
        state.values.update(
            phase="encode", branch=0, branches=branches, grid=list(grid), audio_frames=audio_frames, mel=mel,
            guidance={"video": [p.guidance_scale, p.stg_scale, p.modality_scale, p.guidance_rescale],
                      "audio": list(scales)},
            statics=dict(
                num_frames=grid[0], height=grid[1], width=grid[2], fps=p.fps, audio_num_frames=audio_frames,
                use_cross_timestep=p.use_cross_timestep,
            ),
            stg_blocks=list(p.spatio_temporal_guidance_blocks), cache_hits=0,
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
        draws = NoiseDraws(state.generator, request.params)
        vae, audio_vae, transformer = (self._module(state, n) for n in ("vae", "audio_vae", "transformer"))
        noise = draws.randn(1, vae.config.latent_channels, *grid)
        audio = draws.randn(1, audio_vae.config.latent_channels, audio_frames, state.values["mel"])
        patch, patch_t = transformer.config.patch_size, transformer.config.patch_size_t
        state.tensors.update(
            latents=pack(noise, patch, patch_t), audio_latents=audio.transpose(1, 2).flatten(2, 3)
        )
        if vae.config.timestep_conditioning and not request.carry.get("latents_out"):  # diffusers' next draw
            state.tensors["decode_noise"] = draws.randn(1, vae.config.latent_channels, *grid)

    def _sizes(self, request) -> tuple[tuple[int, int, int], int]:
        """The latent grid (frames, height, width) and the audio latent length of the request."""
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

    def _tokenize(self, inst: LTX2Model, state: LoopState, p: LTX2Params) -> None:
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
                batch_key=BatchKey(
                    self._on(state, "text", "text_encoder", "connectors"),
                    "encode",
                    (ids.shape[1],),
                    precision,
                ),
                batch_size=ids.shape[0],
                label="encode prompt",
            )
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
                batch_key=BatchKey(
                    self._on(state, "audio_vae", "audio_vae", "vocoder"),
                    "audio_decode",
                    tuple(audio.shape[1:]),
                    precision,
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
            "branches": v["branches"],
            "kernels": {"attention": "sdpa"},
            "weights_versions": dict(v["weights_versions"]),  # pinned at init: what it ran on
            **self._extra_metrics(state),
        }
        if v["latents_out"]:
            return LoopResult(self._latents(state), metrics)
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

    def _keys(self, state: LoopState) -> list[CacheKey]:
        inst, ids, mask = self.instance, state.tensors["input_ids"], state.tensors["mask"]
        return [
            CacheKey.of(
                inst.card.model_id,
                "connectors",
                self._pin(state, "connectors"),
                ids[i],
                mask[i],
                max_length=int(ids.shape[-1]),
                precision=str(inst.dtype),
                text_encoder_version=self._pin(state, "text_encoder"),
            )
            for i in range(ids.shape[0])
        ]

    def _pin(self, state: LoopState, component: str) -> str | None:
        """The weights version of ``component`` the request pinned at init (None: the live one)."""
        return state.values.get("weights_versions", {}).get(component)

    def _module(self, state: LoopState, component: str) -> Any:
        """``component`` on the weights the request pinned (a weight sync since leaves it on them)."""
        return self.instance.component(component, self._pin(state, component))

    def _on(self, state: LoopState, label: str, *components: str) -> str:
        """Batch-key instance of plans on the pinned weights of ``components`` (default: ``label``'s);
        plans on other versions never share a call."""
        versions = "+".join(state.values["weights_versions"][c] for c in components or (label,))
        return f"{self.instance.instance_id}@{versions}/{label}"

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
            **self._timesteps(t, state.step, rows),
            # views of the request's positions (a parallel group sends them to its workers once)
            "video_coords": t["video_coords"].expand(rows, *t["video_coords"].shape[1:]),
            "audio_coords": t["audio_coords"].expand(rows, *t["audio_coords"].shape[1:]),
        }
        if self.block_seam:
            inputs[BLOCKS_INPUT] = None  # block-structured body: the runner may attach a block hook here
        statics = {
            **v["statics"],
            "isolate_modalities": branch == "modality",
            "spatio_temporal_guidance_blocks": v["stg_blocks"] if branch == "stg" else None,
        }
        shapes = tuple(tuple(x.shape[1:]) for x in inputs.values() if x is not None)
        graph = f"{type(self).__name__}:{branch}:{sorted(statics.items(), key=str)}"
        body = self._denoise(statics, branch, self._pin(state, "transformer"))
        plan = (
            inst.parallel.plan.id
            if isinstance(body, partial) and body.func is parallel_denoise_body
            else None
        )
        return WorkPlan(
            kind=WorkUnitKind.DIFFUSION_STEP,
            body=body,
            inputs=inputs,
            batch_key=BatchKey(
                self._on(state, "transformer"),
                "diffusion_denoise",
                shapes,
                precision,
                parallel_plan=plan or "single",
                graph_key=graph,
            ),
            batch_size=rows,
            cost_s=self._cost(state) * rows,
            label=f"denoise {state.step + 1}/{state.total_steps} ({branch})",
        )

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
        branch, v, inputs = label.group(1), record.values, dict(step.inputs)
        statics = {
            **v["statics"],
            "isolate_modalities": branch == "modality",
            "spatio_temporal_guidance_blocks": v["stg_blocks"] if branch == "stg" else None,
        }
        if self.block_seam:
            inputs[BLOCKS_INPUT] = None
        rows = inputs["latents"].shape[0]
        body = self._denoise(statics, branch)
        return WorkPlan(WorkUnitKind.DIFFUSION_STEP, body, inputs, batch_size=rows, label=step.label)

    def _combine_and_step(self, state: LoopState) -> None:
        """Combine the branches in x0 space per modality, then one Euler step of both latents."""
        t, v, i = state.tensors, state.values, state.step
        sigma, sigma_next = t["sigmas"][i], t["sigmas"][i + 1]
        for modality, key in (("video", "latents"), ("audio", "audio_latents")):
            sample = t[key]
            gs, stg, mod, factor = v["guidance"][modality]
            if "cfg" in v["branches"]:
                uncond, cond = t[f"cfg.{modality}"].chunk(2)
                x0 = sample - cond * sigma
                guided = x0 + (gs - 1) * (x0 - (sample - uncond * sigma))
            else:
                x0 = guided = sample - t[f"cond.{modality}"] * sigma
            if "stg" in v["branches"]:
                guided = guided + stg * (x0 - (sample - t[f"stg.{modality}"] * sigma))
            if "modality" in v["branches"]:
                guided = guided + (mod - 1) * (x0 - (sample - t[f"modality.{modality}"] * sigma))
            if factor > 0:
                guided = rescale(guided, x0, factor)
            velocity = (sample - guided) / sigma
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
            batch_key=BatchKey(self._on(state, "vae"), "vae_decode", tuple(latents.shape[1:]), precision),
            label="video decode",
        )

    def _cost(self, state: LoopState) -> float:
        cost = self.instance.card.loops[state.loop_id].step_cost
        return cost.base_s + cost.per_token_s * state.tensors["latents"].shape[1]


class LTX2RefineLoop(LTX2Loop):
    """The refine stage of ``t2av-two-stage``: it starts from the upsampled latents its program hands on
    (``request.carry``), re-noised to ``noise_scale``, and denoises them on fixed float sigmas (no
    dynamic shift, no terminal stretch) with guidance off, then decodes video and audio."""

    loop_id = "refine"
    block_seam = False  # 3 distilled steps (nothing to cache) on LoRA-merged weights
    schedule_overrides = {"use_dynamic_shifting": False, "shift_terminal": None}

    def _extra_metrics(self, state: LoopState) -> dict[str, Any]:
        return {"refine_lora": bool(self.instance.refine_weights(self._pin(state, "transformer")))}

    def _denoise(self, statics: dict[str, Any], branch: str, version: str | None = None):
        """With the card's refine LoRA shipped in the folder, the transformer runs with it merged (into
        ``version``'s weights)."""
        weights = self.instance.refine_weights(version)
        if not weights:
            return super()._denoise(statics, branch, version)
        transformer = self.instance.component("transformer", version)
        return partial(lora_denoise_body, transformer, weights, statics, branch)

    def _sizes(self, request) -> tuple[tuple[int, int, int], int]:
        video, audio = request.carry["latents"], request.carry["audio_latents"]
        return tuple(video.shape[2:]), audio.shape[2]  # type: ignore[return-value]

    def _start_latents(self, state: LoopState, request, grid: tuple[int, ...], audio_frames: int) -> None:
        draws, scale = NoiseDraws(state.generator, request.params), request.carry["noise_scale"]
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
        if vae.config.timestep_conditioning:
            state.tensors["decode_noise"] = draws.randn(1, vae.config.latent_channels, *grid)


def upsample_body(upsampler, inputs: dict[str, Any]) -> dict[str, Any]:
    """The latent upsampler on denormalized video latents [B, C, F, H, W] (2x height and width)."""
    return {"latents": upsampler(inputs["latents"].to(upsampler.dtype))}


class LTX2UpsampleLoop:
    """The middle stage of ``t2av-two-stage``: the card's latent upsampler on the base stage's video
    latents (one VAE_TILE unit); the audio latents pass through."""

    def __init__(self, instance: LTX2Model) -> None:
        self.instance = instance

    def init(self, request, instance=None, ctx=None) -> LoopState:
        state = LoopState(request.request_id, "upsample", total_steps=1)
        # the program's weights versions, held while the upsampler runs so the refine stage finds them
        state.values["weights_versions"] = dict(request.carry["weights_versions"])
        state.tensors.update(latents=request.carry["latents"], audio_latents=request.carry["audio_latents"])
        return state

    def next(self, state: LoopState) -> WorkPlan | Done:
        if state.step:
            return Done()
        inst, latents = self.instance, state.tensors["latents"]
        return WorkPlan(
            kind=WorkUnitKind.VAE_TILE,
            body=partial(upsample_body, inst.component("latent_upsampler")),
            inputs={"latents": latents},
            batch_key=BatchKey(
                f"{inst.instance_id}/upsampler", "upsample", tuple(latents.shape[1:]), str(inst.dtype)
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


def encode_image_body(vae, inputs: dict[str, Any]) -> dict[str, Any]:
    """The VAE's latent mode of images [B, 3, H, W] in -1..1, as one-frame videos."""
    return {"latents": vae.encode(inputs["image"].to(vae.dtype).unsqueeze(2)).latent_dist.mode()}


class LTX2ImageLoop(LTX2Loop):
    """``i2av``: the video's first frame is the request's image. The image is re-compressed as LTX-2 was
    trained (H.264 at ``image_crf``), resized, VAE-encoded; its latent frame stays clean (its tokens
    denoise at timestep 0 and are never stepped) while the rest starts from noise."""

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
            batch_key=BatchKey(self._on(state, "vae"), "vae_encode", tuple(image.shape[1:]), precision),
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
        clean = ((image_latents.float() - mean) / std).repeat(
            1, 1, frames, 1, 1
        )  # no scaling_factor here, as diffusers
        mask = torch.zeros((1, 1, frames, height, width), dtype=clean.dtype)
        mask[:, :, 0] = 1.0
        patch, patch_t = transformer.config.patch_size, transformer.config.patch_size_t
        noise = unpack(
            t["latents"], frames, height, width, patch, patch_t
        )  # drawn at init, as diffusers draws it
        t["latents"] = pack(clean * mask + noise * (1 - mask), patch, patch_t)
        t["conditioning_mask"] = pack(mask, patch, patch_t).squeeze(-1)
        del t["image"]
        state.values["phase"] = "denoise"
