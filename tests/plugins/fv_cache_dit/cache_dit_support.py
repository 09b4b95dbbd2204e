"""A block-structured synthetic denoise loop whose step body hands its blocks to the block seam."""

from __future__ import annotations

from typing import Any

import torch

from fv_cache_dit.options import CacheDiTOptions
from fv_core.extend import BLOCKS_INPUT, drive_blocks
from fv_core.loop import (
    BatchKey,
    Done,
    LoopResult,
    LoopState,
    StepResult,
    WorkPlan,
    WorkUnitKind,
    euler_step,
    flow_match_sigmas,
)
from fv_core.request import Request
from tests.runtime.synthetic import DIM, TOKENS, TinyDiT

DEPTH = 6


class BlockDenoiseLoop:
    """Flow-matching Euler with two-forward CFG (branches ``cond`` / ``uncond``) over a 6-block TinyDiT."""

    loop_id = "block_denoise"

    def __init__(self, seed: int = 0) -> None:
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.dit = TinyDiT(depth=DEPTH).eval()

    def init(self, request: Request, instance: Any, ctx: Any) -> LoopState:
        steps = int(request.params.get("steps", 12))
        gen = torch.Generator().manual_seed(request.seed)
        x, cond = torch.randn(1, TOKENS, DIM, generator=gen), torch.randn(1, DIM, generator=gen)
        sigmas = flow_match_sigmas(steps, 3.0).tolist()
        return LoopState(
            request.request_id,
            self.loop_id,
            total_steps=steps,
            tensors={"x": x, "cond": cond},
            values={"sigmas": sigmas, "guidance": float(request.params.get("guidance", 4.0))},
        )

    def next(self, state: LoopState) -> WorkPlan | Done:
        if state.step >= state.total_steps:
            return Done()
        x = state.tensors["x"]
        inputs = {
            "x": x,
            "t": torch.tensor([state.values["sigmas"][state.step]]),
            "cond": state.tensors["cond"],
            BLOCKS_INPUT: None,
        }
        key = BatchKey(f"block-dit-{id(self)}", "diffusion_denoise", tuple(x.shape[1:]), "float32")
        return WorkPlan(WorkUnitKind.DIFFUSION_STEP, self.body, inputs, key, cost_s=1e-3, label="denoise")

    def forward(self, x: torch.Tensor, t: torch.Tensor, cond: torch.Tensor, hook: Any, branch: str):
        dit = self.dit
        h = x + dit.t_embed(t[:, None])[:, None, :] + dit.cond_proj(cond)[:, None, :]
        h = drive_blocks(hook, branch, h, len(dit.blocks), lambda i, hidden, rows=None: dit.blocks[i](hidden))
        return dit.out(h)

    def body(self, inputs: dict[str, Any]) -> dict[str, Any]:
        x, t, cond, hook = inputs["x"], inputs["t"], inputs["cond"], inputs[BLOCKS_INPUT]
        return {
            "cond": self.forward(x, t, cond, hook, "cond"),
            "uncond": self.forward(x, t, torch.zeros_like(cond), hook, "uncond"),
        }

    def advance(self, state: LoopState, result: StepResult) -> LoopState:
        out, s, i = result.outputs, state.values["sigmas"], state.step
        v = out["uncond"] + state.values["guidance"] * (out["cond"] - out["uncond"])
        state.tensors["x"] = euler_step(state.tensors["x"], v, s[i], s[i + 1])
        state.step += 1
        return state

    def finalize(self, state: LoopState) -> LoopResult:
        return LoopResult({"latents": state.tensors["x"]})


def request(rid: str, seed: int = 0, steps: int = 12, **options: Any) -> Request:
    """A request whose fv-cache-dit options (as ``prepare`` validates them) are ``options``."""
    asked = {"fv-cache-dit": CacheDiTOptions(**options)} if options else {}
    return Request(rid, params={"steps": steps}, options=asked, seed=seed)
