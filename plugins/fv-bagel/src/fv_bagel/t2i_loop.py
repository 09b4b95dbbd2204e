"""BAGEL's image denoise loop (task ``t2i``; the image of ``think-t2i``).

``<|vision_start|> latents <|vision_end|>`` is a query over the context that attends to it and to itself
in full and is never written to the cache (the prefix is reused by every step). The latent tokens run on
the generation expert, the two markers on the understanding expert. CFG runs the same query over the
text-unconditioned and image-unconditioned contexts, as extra rows of the step (contexts with a common
prefix share its pages); the guided velocity, its renorm and the Euler update run in ``advance``.

The conditional context of ``t2i`` is the prompt alone: it starts from the prefix cache (requests with
the same prompt prefill nothing) and is recorded there once prefilled.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from fv_bagel import bodies
from fv_bagel.context import check_positions, check_written_by, plain, plan_inputs, text_ids, written
from fv_bagel.guidance import guide, schedule
from fv_bagel.mot import grid_ids
from fv_bagel.prefill import PrefillLoop
from fv_bagel.state import DenoiseState
from fv_core import ConfigError
from fv_core.kv import KVSeq, PagedKVPool
from fv_core.loop import (
    Done,
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

Pending = list[tuple[str, str, dict[str, Any]]]  # prefills: (context written, context extended, segment)


class ImageLoop(PrefillLoop):
    """Image denoise (task ``t2i``): prefill the prompt, then Euler steps over the latent tokens with
    text (and image) CFG, then the FLUX decode. The denoise reuses the contexts' caches, never writes them."""

    CONTEXTS = ("cond", "text_uncond", "img_uncond")

    def init(self, request: Any, instance: Any = None, ctx: Any = None) -> LoopState:
        try:
            return self._init(request)
        except BaseException:  # refused before its state held them: the pages handed over come back
            for context in request.carry.get("contexts", []):
                self.instance.kv_pool.release(KVSeq(**context["seq"]))
            raise

    def _init(self, request: Any) -> LoopState:
        inst = self.instance
        p = request.params
        times, dts = schedule(p.num_inference_steps, p.timestep_shift)
        state = pinned_state(
            request, inst, inst.card.programs[request.task].stages[0], total_steps=len(times)
        )
        net = self._net(state)
        down = 8 * net.latent_patch_size  # the FLUX VAE is x8; 2x2 latent patches
        height, width = self._size(state, request, net)
        rows, cols = height // down, width // down
        if max(rows, cols) > net.max_latent_size:
            most = net.max_latent_size * down
            raise ConfigError(
                f"size {width}x{height} exceeds this model's latent table ({most} px a side). "
                f"Fix: use at most {most}x{most}",
                param="height",
            )
        prompt = text_ids(inst, p.prompt)
        check_positions(net, len(prompt) + 1, f"a prompt of {len(prompt)} tokens")
        dim = net.latent_patch_size**2 * net.latent_channels
        assert state.generator is not None
        draws = NoiseDraws(state.generator, p)
        noise = draws.randn(rows * cols, dim)
        grid = grid_ids(rows, cols, net.max_latent_size).to(inst.device)
        state.tensors.update(latents=noise.to(inst.device), grid=grid)
        # a context is a sequence of the instance's KV pool and its next RoPE position; contexts that
        # share a prefix share its pages (forks, copy-on-write), never copies
        contexts: dict[str, dict[str, Any]] = {
            name: {"seq": plain(KVSeq()), "rope": 0} for name in self.CONTEXTS
        }
        text = {"kind": "text", "ids": prompt}
        pending, aliases = self._contexts(state, request, draws, text, contexts, (rows, cols))
        cond_keys, reused, held = None, 0, 0
        if pending == [("cond", "cond", text)]:  # t2i: the prompt alone, in the prefix cache
            seq, rope, _, left, _ = self._served(state, [text])
            contexts["cond"], reused, cond_keys = {"seq": plain(seq), "rope": rope}, seq.length, list(prompt)
            held = len(seq.pages)
            pending = [("cond", "cond", segment) for segment in left]
        DenoiseState(
            ctx=contexts,
            pending=pending,
            aliases=aliases,
            thinking=request.carry.get("thinking"),
            times=times,
            dts=dts,
            grid_shape=[rows, cols],
            cfg_text_scale=p.cfg_text_scale,
            cfg_img_scale=p.cfg_img_scale,
            cfg_interval=list(p.cfg_interval),
            cfg_renorm_type=p.cfg_renorm_type,
            cfg_renorm_min=p.cfg_renorm_min,
            phase="prefill" if pending else "denoise",
            cond_keys=cond_keys,
            reused=reused,
            held=held,
        ).put(state)
        return state

    def _size(self, state: LoopState, request: Any, net: Any) -> tuple[int, int]:
        """The image's height and width: the request's."""
        return request.params.height, request.params.width

    def _contexts(
        self, state: LoopState, request: Any, draws: NoiseDraws, text: dict[str, Any], contexts: dict[str, Any],
        grid: tuple[int, int],
    ) -> tuple[Pending, dict[str, str]]:  # fmt: skip
        """The prefills of the CFG contexts, and the contexts that alias another one.

        t2i: the text-unconditioned context is the empty one before the prompt; the image-unconditioned
        context holds the prompt (no image), so it IS the conditional one: an alias, not a copy.
        think-t2i: the AR stage's contexts after its system prompt and after the prompt are the text- and
        image-unconditioned ones; the conditional one is the latter plus the thinking. ``grid``: the
        latent patches (rows, cols)."""
        thinking = request.carry.get("thinking")
        if thinking is None:
            return [("cond", "cond", text)], {"img_uncond": "cond"}
        system, with_prompt = request.carry["contexts"][-2:]  # forks the AR stage handed over
        check_written_by(request, pinned(state, "net"))
        pending: Pending = [("cond", "cond", {"kind": "text", "ids": text_ids(self.instance, thinking)})]
        contexts["text_uncond"], contexts["img_uncond"] = system, with_prompt
        cond = self.instance.kv_pool.fork(KVSeq(**with_prompt["seq"]))  # after all that can fail (see init)
        contexts["cond"] = {"seq": plain(cond), "rope": with_prompt["rope"]}
        return pending, {}

    def _ctx(self, s: DenoiseState, name: str) -> dict[str, Any]:
        ctx = s.ctx[s.aliases.get(name, name)]
        return {"seq": ctx["seq"], "pool": self.instance.kv_pool, "rope": ctx["rope"]}

    def kv_need(self, state: LoopState) -> tuple[PagedKVPool, int]:
        """The pool and the most pages this request holds at once: its contexts' pages now (shared pages
        once: handed over by an earlier stage, or forks) plus those its pending prefills write, counting a
        context's partly filled last page as copied. The denoise reads the contexts and writes none."""
        pool, s = self.instance.kv_pool, DenoiseState.of(state)
        own = [c["seq"] for name, c in s.ctx.items() if name not in s.aliases]
        held = len({page for seq in own for page in seq["pages"]})
        length = {name: c["seq"]["length"] for name, c in s.ctx.items()}
        new = 0
        for name, source, segment in s.pending:
            start = length[source]
            length[name] = start + self._tokens(state, segment)
            new += pool.pages_for(length[name]) - start // pool.page_size
        return pool, held + new - s.held

    def release(self, state: LoopState) -> None:
        """Return every context's pages (on finish, and when the request is cancelled or fails)."""
        s = DenoiseState.of(state)
        self.instance.kv_pool.unreserve(s.held)
        s.held = 0
        for name, ctx in s.ctx.items():
            if name not in s.aliases:
                self.instance.kv_pool.release(KVSeq(**ctx["seq"]))
        s.ctx = {}

    def _branches(self, s: DenoiseState, t: float) -> list[str]:
        lo, hi = s.cfg_interval
        if not (lo < t <= hi) or s.cfg_text_scale <= 1.0:
            return ["cond"]  # outside the interval (or without text CFG) the conditional alone
        return ["cond", "text_uncond"] + (["img_uncond"] if s.cfg_img_scale > 1.0 else [])

    def next(self, state: LoopState) -> WorkPlan | Done:
        s = DenoiseState.of(state)
        if s.pending:
            _, source, segment = s.pending[0]
            return self._segment_plan(self._ctx(s, source), segment, state)
        if s.phase == "denoise":
            return self._denoise_plan(state, s)
        if s.phase == "decode":
            return self._decode_plan(state, s)
        return Done()

    def _denoise_plan(self, state: LoopState, s: DenoiseState) -> WorkPlan:
        inst = self.instance
        t = s.times[state.step]
        branches = self._branches(s, t)
        contexts = [self._ctx(s, b) for b in branches]
        rows, n = len(branches), state.tensors["latents"].shape[0]
        dev = inst.device
        sp = inst.special
        pos = torch.tensor([[c["rope"]] * (n + 2) for c in contexts], device=dev)
        inputs = plan_inputs(
            contexts,
            latents=state.tensors["latents"].to(inst.dtype)[None].expand(rows, -1, -1),
            t=torch.full((rows,), t, device=dev),
            ids=torch.tensor([[sp["start_of_image"], sp["end_of_image"]]] * rows, device=dev),
            grid=state.tensors["grid"][None].expand(rows, -1),
            pos=pos,
        )
        body = partial(bodies.denoise_body, self._net(state), inst.exact)
        return WorkPlan(
            kind=WorkUnitKind.DIFFUSION_STEP,
            body=body,
            invariant_body=body if inst.exact else None,  # exact math: rows batch bit for bit
            inputs=inputs,
            batch_key=self._key(state, "diffusion_denoise", (*s.grid_shape, inputs["ctx_valid"].shape[1])),
            batch_size=rows,
            label=f"denoise {state.step + 1}/{state.total_steps} ({'+'.join(branches)})",
        )

    def _decode_plan(self, state: LoopState, s: DenoiseState) -> WorkPlan:
        inst = self.instance
        net = self._net(state)
        rows, cols = s.grid_shape
        p, c = net.latent_patch_size, net.latent_channels
        x = state.tensors["latents"].reshape(rows, cols, p, p, c)
        latents = torch.einsum("hwpqc->chpwq", x).reshape(1, c, rows * p, cols * p)
        return WorkPlan(
            kind=WorkUnitKind.VAE_TILE,
            body=partial(bodies.decode_body, pinned_module(inst, state, "vae")),
            inputs={"latents": latents},
            # the VAE's convolutions are not row-invariant: the exact instance decodes each image alone
            batch_key=None if inst.exact else self._key(state, "vae_decode", tuple(latents.shape[1:]), "vae"),
            label="vae decode",
        )

    def advance(self, state: LoopState, result: StepResult) -> LoopState:
        out, s = result.outputs, DenoiseState.of(state)
        if s.pending:
            name, source, segment = s.pending.pop(0)
            pool, src = self.instance.kv_pool, s.ctx[source]
            if name == source:  # extend the context itself
                base = KVSeq(**src["seq"])
            else:  # a new context over the source's pages (shared, not copied)
                pool.release(KVSeq(**s.ctx[name]["seq"]))
                base = pool.fork(KVSeq(**src["seq"]))
            advance = len(segment["ids"]) if segment["kind"] == "text" else 1
            seq = pool.append(base, *written(out, segment))
            s.ctx[name] = {"seq": plain(seq), "rope": src["rope"] + advance}
            if name == "cond" and s.cond_keys is not None:
                self._remember(state, s.cond_keys, s.ctx[name]["seq"])
            if not s.pending:
                s.phase = "denoise"
            return state
        if s.phase == "decode":
            state.tensors["frames"] = out["frames"]
            s.phase = "done"
            return state
        branches = self._branches(s, s.times[state.step])
        rows = dict(zip(branches, out["velocity"].float(), strict=True))
        velocity = guide(
            rows["cond"], rows.get("text_uncond"), rows.get("img_uncond"), s.cfg_text_scale, s.cfg_img_scale,
            s.cfg_renorm_type, s.cfg_renorm_min,
        )  # fmt: skip
        state.tensors["latents"] = state.tensors["latents"] - velocity * s.dts[state.step]
        s.branches_run.append(len(branches))
        state.step += 1
        if state.step == state.total_steps:
            s.phase = "decode"
        return state

    def finalize(self, state: LoopState) -> LoopResult:
        self.release(state)
        s = DenoiseState.of(state)
        outputs: dict[str, Any] = {"frames": state.tensors["frames"], "latents": state.tensors["latents"]}
        if s.thinking is not None:
            outputs["text"] = s.thinking  # think-t2i: the plan the image was made from
        return LoopResult(
            outputs=outputs,
            metrics={
                "steps": state.step,
                "branches_run": s.branches_run,
                "cached_prompt_tokens": s.reused,  # served by the prefix cache, not prefilled
            },
        )
