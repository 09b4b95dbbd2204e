"""The causal Wan loop: encode -> text K/V -> per chunk (denoise steps -> decode -> cache write).

A request's latent frames are made ``chunk_frames`` at a time. Each chunk starts from its slice of
the request's noise and runs the card's fixed timesteps (predict the velocity, take x0, re-noise to the
next timestep with the request's generator), one DIFFUSION_STEP each. The finished chunk is decoded
at once by the VAE, frame by frame, carrying the decoder's causal feature cache in the LoopState
(a VAE_TILE step whose ``partial`` event carries the chunk's frames: what a stream shows), and,
unless it is the last, run once more at the context timestep over the same context as its denoise
steps (an AR_PREFILL step). Its every block's keys/values then go into the request's sequence of the
instance's paged KV pool, after the rolling window has dropped the oldest frames after the sinks to
make room (whole pages when frames fill whole pages, else a copy of the kept tokens). A session continued
under a new prompt may first re-cache its window under the new text (:mod:`fv_wan.causal_recache`).

A chunk pass is one body (:func:`fv_wan.causal_transformer.chunk_body`) for both kinds: its inputs
are the chunk's latents, timestep, per-frame RoPE and its context gathered from the pool, padded to a
power-of-two number of frames (at most the window: :mod:`fv_wan.causal_window`) with a mask of real
tokens, so passes of different requests with equal chunk shapes and context buckets batch as rows. The
final video is the chunks' frames in order; the pool's pages come back on finish and on cancel
(``release``).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from fv_core import ConfigError
from fv_core.extend import KV_INPUT
from fv_core.kv import KVSeq, PagedKVPool
from fv_core.loop import (
    Done,
    LoopKind,
    LoopResult,
    LoopState,
    StepResult,
    WorkPlan,
    WorkUnitKind,
    batch_key,
    pinned_module,
)
from fv_wan import causal_recache
from fv_wan.bodies import chunk_decode_body
from fv_wan.causal_transformer import chunk_body, frame_rope
from fv_wan.causal_window import cache_layout, context_frames, drop_tokens, evict, policy_evict, runs
from fv_wan.model import CausalWanModel
from fv_wan.params import CausalWanParams
from fv_wan.samplers import chunk_schedule, renoise, shifted
from fv_wan.sessions import session_shape
from fv_wan.t2v_loop import WanLoop
from fv_wan.text_cache import cached_kv, clean_prompt, set_embeds, text_keys
from fv_wan.variant import HIGH_NOISE

DIT = HIGH_NOISE  # the transformer component


class CausalWanLoop(WanLoop):
    """The loop of causal Wan cards (task ``t2v``), bound to one live CausalWanModel. The prompt's
    encode and text keys/values are WanLoop's; every request's state is its LoopState."""

    instance: CausalWanModel

    def __init__(self, instance: CausalWanModel) -> None:
        if not isinstance(instance, CausalWanModel):
            raise ConfigError(
                f"a CausalWanLoop runs on a CausalWanModel (it owns the KV pool), not {type(instance).__name__}. "
                "Fix: load a causal card with fv_core.load(...) (its instance_factory makes one)."
            )
        super().__init__(instance)

    def init(self, request, instance=None, ctx=None) -> LoopState:
        p = request.params
        state = super().init(request, instance, ctx)
        inst, t, v = self.instance, state.tensors, state.values
        fixed = inst.card.loops[state.loop_id].steps.fixed_timesteps
        if not fixed:
            raise ConfigError(
                f"card {inst.card.model_id!r} loop {state.loop_id!r} pins no fixed_timesteps; a causal loop runs a "
                "fixed few-step schedule per chunk. Fix: set steps.fixed_timesteps on the card's loop."
            )
        train_steps = int(inst.scheduler_config.get("num_train_timesteps", 1000))
        timesteps, sigmas = chunk_schedule(fixed, p.flow_shift, train_steps)
        noise = t.pop("latents")
        n = p.chunk_frames
        chunks = noise.shape[2] // n
        _, p_h, p_w = inst.variant.patch
        t.update(timesteps=timesteps, sigmas=sigmas, noise=noise, x=noise[:, :, :n].clone())
        v.update(
            chunk=0,
            chunks=chunks,
            chunk_step=0,
            chunk_frames=n,
            decoded=False,
            window=p.window_frames,
            sink=p.sink_frames,
            context_sigma=shifted(p.context_timestep, p.flow_shift, train_steps),
            train_steps=train_steps,
            tokens_per_frame=(noise.shape[3] // p_h) * (noise.shape[4] // p_w),
            seq={"pages": [], "length": 0},  # the request's sequence of the KV pool
            cache_frames=[],  # the latent frames it holds, in order
            evicted=[],  # frames the rolling window dropped
            max_cached_frames=0,
            vae_cache=None,  # markers of the decoder's feature cache (tensors under "vae_cache.<i>")
            offset=0,  # latent frames before this request's (a session's video so far)
            session=None,  # the session it continues
            recache=[],  # re-cache passes left (cache_frames index runs): fv_wan.causal_recache
            recached_frames=0,
            text=causal_recache.text_tag(p),  # the text its chunks attend to
        )
        if p.session_id is not None:
            self._continue(state, p, p.session_id)
        if p.steer_from is not None and p.steer_strength < 1:
            self._steer(state, p)
        writes = chunks if v["session"] else chunks - 1  # a session keeps its last chunk for the next request
        # transformer passes: re-cache passes, denoise steps and writes
        state.total_steps = len(v["recache"]) + chunks * v["steps"] + writes
        v["phase"] = self._next_phase(state)
        return state

    def _continue(self, state: LoopState, p: CausalWanParams, sid: str) -> None:
        """Start from the session's video: a fork of its pages, its window, frame count and decoder cache."""
        inst, v = self.instance, state.values
        shape = session_shape(p, state)
        session = inst.sessions.claim(sid, state.request_id, shape)
        if session.frames + v["chunks"] * v["chunk_frames"] > inst.rope_frames:
            inst.sessions.release(session.id, state.request_id)
            raise ConfigError(
                f"session {session.id!r} has {session.frames} latent frames; {v['chunks'] * v['chunk_frames']} more "
                f"pass the {inst.rope_frames} positions of Wan's rope table. Fix: close it and open a new session.",
                param="session_id",
            )
        seq = inst.kv_pool.fork(KVSeq(**session.seq))
        v.update(
            session=session.id,
            shape=shape,
            offset=session.frames,
            seq={"pages": list(seq.pages), "length": seq.length},
            cache_frames=list(session.cache_frames),
        )
        # the window's clean latents, kept for the session's next re-cache
        latents = session.latents
        state.tensors["window"] = latents if latents is not None else state.tensors["x"][:, :, :0]
        causal_recache.start(state, session, p)
        if session.vae_cache is not None:
            self._keep_vae_cache(state, session.vae_cache)

    def _steer(self, state: LoopState, p: CausalWanParams) -> None:
        """Steering: encode ``steer_from`` as a second prompt row; the chunks attend to the text keys/values
        ``steer_strength * prompt's + (1 - steer_strength) * steer_from's``."""
        inst, t = self.instance, state.tensors
        enc = inst.component("tokenizer")(
            [clean_prompt(p.prompt), clean_prompt(p.steer_from or "")], padding="max_length",
            max_length=p.max_sequence_length, truncation=True, add_special_tokens=True,
            return_attention_mask=True, return_tensors="pt",
        )  # fmt: skip
        t.update(input_ids=enc.input_ids, mask=enc.attention_mask)
        t.pop("text", None)
        state.values["steer_strength"] = p.steer_strength
        cached = [inst.feature_cache.get(k) for k in text_keys(inst, state)]
        state.values["cache_hits"] = sum(c is not None for c in cached)
        if all(c is not None for c in cached):
            set_embeds(state, torch.stack(cached))

    def _next_phase(self, state: LoopState) -> str:
        """What the request still lacks: text, its keys/values, then per chunk: denoise steps, the chunk's
        frames, its cache write (not for the last chunk)."""
        t, v = state.tensors, state.values
        if "chunks" not in v:
            return "init"  # WanLoop.init asks before this loop's init has set the chunks up
        if "text" not in t:
            return "encode"
        fold = self.instance.parallel is None  # text keys/values kept folded (without the padding's repeats)
        if f"kv.{DIT}" not in t and not cached_kv(self.instance, state, DIT, fold):
            v.update(kv_for=DIT, kv_fold=fold)
            return "text_kv"
        if v["recache"]:
            return "recache"
        if v["chunk"] >= v["chunks"]:
            return "done"
        if v["chunk_step"] < v["steps"]:
            return "chunk_denoise"
        return "chunk_write" if v["decoded"] else "chunk_decode"

    def next(self, state: LoopState) -> WorkPlan | Done:
        phase = state.values["phase"]
        if phase in ("chunk_denoise", "chunk_write"):
            return self._chunk_plan(state, write=phase == "chunk_write")
        if phase == "chunk_decode":
            return self._decode_plan(state)
        if phase == "recache":
            r = causal_recache.pass_inputs(state)
            return self._pass_plan(state, **r, room=-1, kind=WorkUnitKind.AR_PREFILL)
        if phase == "done":
            return Done()
        return super().next(state)  # encode, text keys/values

    def advance(self, state: LoopState, result: StepResult) -> LoopState:
        phase = state.values["phase"]
        if phase == "chunk_denoise":
            self._denoised(state, result.outputs)
        elif phase == "chunk_write":
            self._written(state, result.outputs)
        elif phase == "chunk_decode":
            self._decoded(state, result)
        elif phase == "recache":
            causal_recache.fold(self.instance.kv_pool, state, result.outputs)
        else:
            return super().advance(state, result)
        state.values["phase"] = self._next_phase(state)
        return state

    def finalize(self, state: LoopState) -> LoopResult:
        v, t = state.values, state.tensors
        kv_bytes = len(v["seq"]["pages"]) * self.instance.kv_pool.page_bytes  # its cache at the end
        self.release(state)
        metrics = {
            "steps": v["steps"],  # denoise steps per chunk (num_inference_steps)
            "passes": state.step,  # transformer passes: every chunk's steps and the cache writes
            "chunks": v["chunks"],
            "chunk_frames": v["chunk_frames"],
            "text_cache_hits": v["cache_hits"],
            "kv_cache_hits": v["kv_cache_hits"],
            "sampler": "dmd",
            "cfg": "off",
            "evicted_frames": list(v["evicted"]),
            "max_cached_frames": v["max_cached_frames"],
            "kv_bytes": kv_bytes,
            "session": v["session"],  # the session it continued (None: a video of its own)
            "first_latent_frame": v["offset"],  # of the session's video
            "recached_frames": v["recached_frames"],  # cached frames re-run under a new prompt
            "kernels": {"attention": "sdpa (block-causal, fv_wan.causal_transformer)"},
        }
        return LoopResult({"frames": t["frames"], "latents": t["latents"]}, metrics)

    def estimate(self, state: LoopState) -> tuple[float, int]:
        """Predicted seconds of the transformer passes left (each over a chunk and at most a window of
        context); decode and encode are small."""
        v = state.values
        if "chunks" not in v:
            return 0.0, 0
        cost = self.instance.card.loops[state.loop_id].step_cost
        tokens = (v["chunk_frames"] + v["window"]) * v["tokens_per_frame"]
        left = (state.total_steps or 0) - state.step
        return left * (cost.base_s + cost.per_token_s * tokens), 0

    def kv_need(self, state: LoopState) -> tuple[PagedKVPool, int]:
        """The pool and the most pages the request holds: its window full (or every chunk but the last,
        which is never written, when that is fewer frames)."""
        pool, v = self.instance.kv_pool, state.values
        frames = min(v["window"], (v["chunks"] - 1) * v["chunk_frames"])
        return pool, pool.pages_for(frames * v["tokens_per_frame"])

    def release(self, state: LoopState) -> None:
        """Return the request's pages to the pool (on finish, and when it is cancelled or fails), and its
        session (which keeps its own pages) to the next request."""
        causal_recache.release(self.instance.kv_pool, state)
        seq = state.values.get("seq")
        if seq and seq["pages"]:
            self.instance.kv_pool.release(KVSeq(**seq))
        state.values["seq"] = {"pages": [], "length": 0}
        if state.values.get("session"):
            self.instance.sessions.release(state.values["session"], state.request_id)

    def replay_plan(self, record: Any, step: Any) -> WorkPlan:
        """A recorded chunk pass (denoise step or cache write) as a plan on the live weights: the chunk
        body over its recorded inputs, which hold the context it gathered from the pool; the prompt's
        encode and text keys/values are WanLoop's. A chunk's decode carries the VAE's feature cache,
        which records do not hold."""
        kind = WorkUnitKind(step.kind)
        if kind in (WorkUnitKind.DIFFUSION_STEP, WorkUnitKind.AR_PREFILL):
            inputs = dict(step.inputs)
            body = partial(chunk_body, self.instance.component(DIT))
            return WorkPlan(kind, body, inputs, batch_size=inputs["latents"].shape[0], label=step.label)
        if kind == WorkUnitKind.VAE_TILE:
            raise ConfigError(
                f"step {step.label!r} decodes a chunk with the VAE's feature cache of the chunks before it, which "
                "a record does not hold. Fix: replay the chunk passes (denoise steps and cache writes)."
            )
        return super().replay_plan(record, step)

    # ---- plans ----

    def _chunk_plan(self, state: LoopState, write: bool) -> WorkPlan:
        t, v = state.tensors, state.values
        c, n, s = v["chunk"], v["chunk_frames"], v["chunk_step"]
        if write:
            latents, timestep = t["context"], v["context_sigma"] * v["train_steps"]
        else:
            latents, timestep = t["x"], float(t["timesteps"][s])
        room = max(len(v["cache_frames"]) + n - v["window"], 0) if write else -1
        label = f"chunk {c + 1}/{v['chunks']} " + ("cache write" if write else f"step {s + 1}/{v['steps']}")
        return self._pass_plan(
            state, latents, timestep, v["offset"] + c * n, KVSeq(**v["seq"]), v["cache_frames"], room,
            WorkUnitKind.AR_PREFILL if write else WorkUnitKind.DIFFUSION_STEP, label,
        )  # fmt: skip

    def _pass_plan(
        self, state: LoopState, latents: torch.Tensor, timestep: float, start: int, seq: KVSeq,
        frames: list[int], room: int, kind: WorkUnitKind, label: str,
    ) -> WorkPlan:  # fmt: skip
        """A pass of the chunk body over ``latents`` (latent frames from ``start``) at ``timestep``, its
        context ``seq`` holding ``frames``; ``room``: what a cache write must evict first (-1: no write)."""
        inst, t, v = self.instance, state.tensors, state.values
        transformer = pinned_module(inst, state, DIT)
        pool, tpf, n = inst.kv_pool, v["tokens_per_frame"], v["chunk_frames"]
        ctx = pool.gather([seq], context_frames(len(frames), v["window"]) * tpf)
        cos, sin = frame_rope(transformer, start, latents.shape[2], latents.shape[3], latents.shape[4])
        kv, held = t[f"kv.{DIT}"][:1], t.get(f"kv_rows.{DIT}")
        if t[f"kv.{DIT}"].shape[0] > 1:  # steering: blend the prompt's text keys/values into steer_from's
            s = v["steer_strength"]  # (folded rows repeat their last position up to the longer one's)
            kv = (s * kv.float() + (1 - s) * t[f"kv.{DIT}"][1:2].float()).to(kv.dtype)
        inputs = {
            "latents": latents.to(inst.dtype),
            "timestep": torch.tensor([timestep], dtype=torch.float32, device=latents.device),
            "kv": kv,
            "rope_cos": cos,
            "rope_sin": sin,
            **ctx,
            **cache_layout(frames, n, v["sink"], tpf, ctx["ctx_k"].shape[3], room, pool.k.device),
            KV_INPUT: None,  # a KV policy may pick each layer's context and what leaves the cache
        }
        kv_sig: tuple = tuple(kv.shape[1:])
        if held is not None:  # folded: batches with other prompts' folds of any length, zero-padded
            length = t["input_ids"].shape[1]
            inputs.update(kv_rows=torch.tensor([kv.shape[3]]), kv_length=length)
            kv_sig = (*kv.shape[1:3], kv.shape[4], length)
        precision = str(inst.dtype).removeprefix("torch.")
        shape_sig = (tuple(latents.shape[1:]), kv_sig, int(ctx["ctx_k"].shape[3]))
        cost = inst.card.loops[state.loop_id].step_cost
        tokens = cos.shape[1] + ctx["ctx_k"].shape[3]
        return WorkPlan(
            kind=kind,
            body=partial(chunk_body, transformer),
            inputs=inputs,
            # denoise steps, cache writes and re-cache passes are one body: any batches with the others
            batch_key=batch_key(inst, state, DIT, LoopKind.CHUNK_ROLLOUT.value, shape_sig, precision),
            ragged={"kv": 3} if held is not None else {},
            cost_s=cost.base_s + cost.per_token_s * tokens,
            label=label,
        )

    def _decode_plan(self, state: LoopState) -> WorkPlan:
        """The chunk's decode; it batches with other requests' decodes whose feature caches match in shape
        (sessions past the same number of frames' start-up)."""
        inst, t, v = self.instance, state.tensors, state.values
        vae = pinned_module(inst, state, "vae")
        markers = v["vae_cache"]
        inputs: dict[str, Any] = {
            "latents": t["x"],
            "cache_markers": None if markers is None else tuple(markers),
        }
        shapes = []
        for i, m in enumerate(markers or []):
            if m == "tensor":
                inputs[f"cache.{i}"] = t[f"vae_cache.{i}"]
                shapes.append(tuple(t[f"vae_cache.{i}"].shape[1:]))
        signature = (tuple(t["x"].shape[1:]), inputs["cache_markers"], tuple(shapes))
        precision = str(inst.dtype).removeprefix("torch.")
        return WorkPlan(
            kind=WorkUnitKind.VAE_TILE,
            body=partial(chunk_decode_body, vae),
            inputs=inputs,
            batch_key=batch_key(inst, state, "vae", "chunk_decode", signature, precision),
            emits=("progress", "partial"),
            label=f"decode chunk {v['chunk'] + 1}/{v['chunks']}",
        )

    # ---- folding results ----

    def _denoised(self, state: LoopState, out: dict[str, Any]) -> None:
        """A few-step update: x0 from the velocity, re-noised to the next timestep (x0 after the last)."""
        t, v = state.tensors, state.values
        i, sigmas = v["chunk_step"], t["sigmas"]
        x0 = t["x"] - sigmas[i] * out["velocity"].float()
        t["x"] = renoise(x0, float(sigmas[i + 1]), state.generator)
        v["chunk_step"] += 1
        state.step += 1
        if v["chunk_step"] == v["steps"]:  # the chunk is clean
            t["latents"] = t["x"] if "latents" not in t else torch.cat([t["latents"], t["x"]], 2)
            if (
                v["chunk"] < v["chunks"] - 1 or v["session"]
            ):  # the cache write runs the chunk at the context timestep
                t["context"] = renoise(t["x"], v["context_sigma"], state.generator)

    def _decoded(self, state: LoopState, result: StepResult) -> None:
        """Keep the chunk's frames and the decoder's cache; the step's stream event carries the frames."""
        t, v, out = state.tensors, state.values, result.outputs
        frames = out["frames"][0]
        t["frames"] = frames if "frames" not in t else torch.cat([t["frames"], frames], 0)
        cache = [out[f"cache.{i}"] if m == "tensor" else m for i, m in enumerate(out["cache_markers"])]
        self._keep_vae_cache(state, cache)
        # the step's "partial" event: this chunk's frames and latents (a stream consumer holds no cache)
        result.outputs = {"chunk": v["chunk"], "frames": frames, "latents": t["x"]}
        v["decoded"] = True
        if v["chunk"] == v["chunks"] - 1 and not v["session"]:  # the last chunk is not written
            v["chunk"] += 1

    def _written(self, state: LoopState, out: dict[str, Any]) -> None:
        """Make room under the window (dropping the oldest frames after the sinks), then append the chunk's
        keys/values; the next chunk starts from its noise."""
        pool, t, v = self.instance.kv_pool, state.tensors, state.values
        n, tpf, frames = v["chunk_frames"], v["tokens_per_frame"], v["cache_frames"]
        if "kv_evict" in out:  # a KV policy's choice of whole blocks
            kept, dropped = policy_evict(frames, n, v["window"], out["kv_evict"])
        else:
            kept, dropped = evict(frames, n, v["window"], v["sink"])
        seq = KVSeq(**v["seq"])
        for start, end in reversed(runs([frames.index(f) for f in dropped])):
            seq = drop_tokens(pool, seq, start * tpf, end * tpf)
        v["evicted"].extend(dropped)
        seq = pool.append(seq, out["k"][0], out["v"][0])
        c, first = v["chunk"], v["offset"] + v["chunk"] * n
        v["seq"] = {"pages": list(seq.pages), "length": seq.length}
        v["cache_frames"] = kept + list(range(first, first + n))
        v["max_cached_frames"] = max(v["max_cached_frames"], len(v["cache_frames"]))
        state.step += 1
        del t["context"]
        v.update(chunk=c + 1, chunk_step=0, decoded=False)
        t["x"] = t["noise"][:, :, (c + 1) * n : (c + 2) * n].clone()
        if v["session"]:  # the session goes on from this chunk
            old = [frames.index(f) for f in kept]
            t["window"] = torch.cat([t["window"][:, :, old], t["latents"][:, :, -n:]], 2)
            window = pool.pages_for(v["window"] * tpf)
            self.instance.sessions.commit(
                v["session"], state.request_id, seq, v["cache_frames"], first + n, self._vae_cache(state) or [],
                v["shape"], window, t["window"], v["text"],
            )  # fmt: skip

    @staticmethod
    def _vae_cache(state: LoopState) -> list | None:
        """The decoder's feature cache as its decode reads it (None before the first chunk)."""
        markers = state.values["vae_cache"]
        if markers is None:
            return None
        return [state.tensors[f"vae_cache.{i}"] if m == "tensor" else m for i, m in enumerate(markers)]

    @staticmethod
    def _keep_vae_cache(state: LoopState, cache: list) -> None:
        """Store the decoder's feature cache in the LoopState: tensors by index, other entries as markers."""
        markers = []
        for i, entry in enumerate(cache):
            if isinstance(entry, torch.Tensor):
                state.tensors[f"vae_cache.{i}"] = entry
                markers.append("tensor")
            else:
                state.tensors.pop(f"vae_cache.{i}", None)
                markers.append(entry)
        state.values["vae_cache"] = markers
