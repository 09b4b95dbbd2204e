"""Synthetic loops made of small real torch modules, for runtime tests and benches.

- TinyDiT: one transformer used both as a flow-matching denoiser and as an AR
  token model (a shared component, as in MoT omni models).
- DenoiseLoop: flow-matching Euler with CFG, optionally followed by VAE_TILE
  units decoding the latents tile by tile (heterogeneous WorkUnit kinds).
- DecodeLoop: AR decoding with EOS and max tokens; sampling uses the
  request's generator in ``advance``.
- NullLoop: steps that do nothing (scheduler overhead benchmarks).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from fv_core.errors import ConfigError
from fv_core.extend import plugin_slot
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

DIM, TOKENS, VOCAB, PIXELS = 16, 8, 32, 12


class TinyDiT(nn.Module):
    """A 2-block transformer: velocity head for latents, logits head for tokens."""

    def __init__(self, dim: int = DIM, vocab: int = VOCAB, depth: int = 2) -> None:
        super().__init__()
        self.t_embed = nn.Sequential(nn.Linear(1, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.cond_proj = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, 2, 2 * dim, dropout=0.0, batch_first=True) for _ in range(depth)
        )
        self.out = nn.Linear(dim, dim)
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.lm_head = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor, t: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        h = x + self.t_embed(t[:, None])[:, None, :] + self.cond_proj(cond)[:, None, :]
        for block in self.blocks:
            h = block(h)
        return self.out(h)

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(tokens)
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        for block in self.blocks:
            h = block(h, src_mask=mask, is_causal=True)
        return self.lm_head(h[:, -1])


class SyntheticModel(nn.Module):
    """The live instance: a shared transformer plus a tiny tile decoder."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.dit = TinyDiT()
            self.vae = nn.Sequential(nn.Linear(DIM, 32), nn.SiLU(), nn.Linear(32, PIXELS))
        self.weights_version = "v1"
        self.eval()


def _key(model: nn.Module, kind: str, shape: tuple, variant: str = "") -> BatchKey:
    return BatchKey(f"synthetic-{id(model)}", kind, shape, "float32", graph_key=variant)


class DenoiseLoop:
    """Flow-matching Euler denoise (+ optional VAE tiles). Params: steps, guidance, shift, tiles, tokens/cond."""

    loop_id = "denoise"

    def __init__(self, model: SyntheticModel, step_cost_s: float = 1e-3, sleep_s: float = 0.0) -> None:
        self.model = model
        self.step_cost_s = step_cost_s  # predicted seconds per denoise step (deliberately rough)
        self.sleep_s = sleep_s  # extra real time per step (calibration tests)

    def init(self, request: Any, instance: Any, ctx: Any) -> LoopState:
        if instance is not self.model:
            raise ConfigError("DenoiseLoop is bound to one SyntheticModel; pass that instance")
        p = request.params
        steps, tiles = int(p.get("steps", 4)), int(p.get("tiles", 0))
        gen = torch.Generator(device=ctx.device).manual_seed(request.seed)
        x = torch.randn(1, TOKENS, DIM, generator=gen, device=ctx.device)
        if "tokens" in p:  # conditioning from an earlier AR stage, through the same shared transformer
            with torch.no_grad():
                cond = self.model.dit.embed_tokens(p["tokens"].reshape(1, -1)).mean(1)
        else:
            cond = torch.randn(1, DIM, generator=gen, device=ctx.device)
        sigmas = flow_match_sigmas(steps, float(p.get("shift", 3.0)))
        return LoopState(
            request.request_id,
            self.loop_id,
            total_steps=steps + tiles,
            generator=gen,
            tensors={"x": x, "cond": cond},
            values={
                "steps": steps,
                "tiles": tiles,
                "sigmas": sigmas.tolist(),
                "guidance": float(p.get("guidance", 3.0)),
                "weights_versions": {"dit": self.model.weights_version},
                "decoded": [],
            },
        )

    def estimate(self, state: LoopState) -> tuple[float, int]:
        v = state.values
        denoise_left = max(v["steps"] - state.step, 0)
        tiles_left = state.total_steps - state.step - denoise_left
        return denoise_left * self.step_cost_s + tiles_left * self.step_cost_s / 4, 64 * TOKENS * DIM * 4

    def next(self, state: LoopState) -> WorkPlan | Done:
        v, i = state.values, state.step
        if i >= state.total_steps:
            return Done()
        if i < v["steps"]:
            x = state.tensors["x"]
            return WorkPlan(
                kind=WorkUnitKind.DIFFUSION_STEP,
                body=self.denoise_body,
                inputs={
                    "x": x,
                    "t": torch.tensor([v["sigmas"][i]]),
                    "cond": state.tensors["cond"],
                    "g": torch.tensor([[[v["guidance"]]]]),
                },
                batch_key=_key(self.model, "diffusion_denoise", (tuple(x.shape[1:]),)),
                cost_s=self.step_cost_s,
                peak_bytes=64 * x.numel() * 4,
                label=f"denoise {i + 1}/{v['steps']}",
            )
        tile = i - v["steps"]
        rows = TOKENS // v["tiles"]
        latents = state.tensors["x"][:, tile * rows : (tile + 1) * rows]
        return WorkPlan(
            kind=WorkUnitKind.VAE_TILE,
            body=self.tile_body,
            inputs={"z": latents},
            batch_key=_key(self.model, "vae_decode", (tuple(latents.shape[1:]),)),
            cost_s=self.step_cost_s / 4,
            peak_bytes=16 * latents.numel() * 4,
            emits=("progress", "partial"),
            label=f"vae tile {tile + 1}/{v['tiles']}",
        )

    def denoise_body(self, inputs: dict[str, Any]) -> dict[str, Any]:
        x, t, cond, g = inputs["x"], inputs["t"], inputs["cond"], inputs["g"]
        v_cond = self.model.dit(x, t, cond)
        v_uncond = self.model.dit(x, t, torch.zeros_like(cond))
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return {"v": v_uncond + g * (v_cond - v_uncond)}

    def tile_body(self, inputs: dict[str, Any]) -> dict[str, Any]:
        return {"pixels": self.model.vae(inputs["z"])}

    def advance(self, state: LoopState, result: StepResult) -> LoopState:
        v, i = state.values, state.step
        if i < v["steps"]:
            s = v["sigmas"]
            state.tensors["x"] = euler_step(state.tensors["x"], result.outputs["v"], s[i], s[i + 1])
        else:
            state.tensors[f"tile{i - v['steps']}"] = result.outputs["pixels"]
        state.step += 1
        return state

    def finalize(self, state: LoopState) -> LoopResult:
        outputs = {"latents": state.tensors["x"]}
        if state.values["tiles"]:
            tiles = [state.tensors[f"tile{k}"] for k in range(state.values["tiles"])]
            outputs["pixels"] = torch.cat(tiles, dim=1)
        return LoopResult(outputs)


class DecodeLoop:
    """AR decode: params prompt (list of ints), max_tokens, eos, temperature (0 = greedy)."""

    loop_id = "decode"

    def __init__(self, model: SyntheticModel, step_cost_s: float = 5e-4) -> None:
        self.model = model
        self.step_cost_s = step_cost_s

    def init(self, request: Any, instance: Any, ctx: Any) -> LoopState:
        if instance is not self.model:
            raise ConfigError("DecodeLoop is bound to one SyntheticModel; pass that instance")
        p = request.params
        gen = torch.Generator(device=ctx.device).manual_seed(request.seed)
        prompt = [int(t) for t in p.get("prompt", [1, 2, 3])]
        return LoopState(
            request.request_id,
            self.loop_id,
            total_steps=int(p.get("max_tokens", 8)),  # budgeted at the cap, refunded on early EOS
            generator=gen,
            values={
                "prompt": prompt,
                "generated": [],
                "eos": int(p.get("eos", -1)),
                "temperature": float(p.get("temperature", 1.0)),
            },
        )

    def next(self, state: LoopState) -> WorkPlan | Done:
        v = state.values
        if v["generated"] and v["generated"][-1] == v["eos"]:
            return Done("eos")
        if state.step >= state.total_steps:
            return Done("max_tokens")
        tokens = torch.tensor([v["prompt"] + v["generated"]])
        return WorkPlan(
            kind=WorkUnitKind.AR_TOKEN,
            body=self.token_body,
            inputs={"tokens": tokens},
            batch_key=_key(self.model, "ar_decode", (tokens.shape[1],)),
            cost_s=self.step_cost_s,
            peak_bytes=tokens.numel() * DIM * 4 * 16,
            label=f"token {state.step + 1}",
        )

    def token_body(self, inputs: dict[str, Any]) -> dict[str, Any]:
        return {"logits": self.model.dit.logits(inputs["tokens"])}

    def advance(self, state: LoopState, result: StepResult) -> LoopState:
        logits, temp = result.outputs["logits"][0], state.values["temperature"]
        if temp == 0:
            token = int(logits.argmax())
        else:
            token = int(torch.multinomial(torch.softmax(logits / temp, -1), 1, generator=state.generator))
        state.values["generated"].append(token)
        state.step += 1
        return state

    def finalize(self, state: LoopState) -> LoopResult:
        return LoopResult({"tokens": torch.tensor(state.values["generated"], dtype=torch.long)})


def _null_body(inputs: dict[str, Any]) -> dict[str, Any]:
    return {}


class NullLoop:
    """``steps`` WorkUnits that do nothing: measures pure scheduler overhead."""

    loop_id = "null"

    def init(self, request: Any, instance: Any, ctx: Any) -> LoopState:
        return LoopState(request.request_id, self.loop_id, total_steps=int(request.params.get("steps", 10)))

    def next(self, state: LoopState) -> WorkPlan | Done:
        if state.step >= state.total_steps:
            return Done()
        return WorkPlan(WorkUnitKind.DIFFUSION_STEP, _null_body, {}, cost_s=1e-6, label="null")

    def advance(self, state: LoopState, result: StepResult) -> LoopState:
        state.step += 1
        return state

    def finalize(self, state: LoopState) -> LoopResult:
        return LoopResult({"steps": state.step})


_LAST_PREDICTION: dict[str, torch.Tensor] = {}  # THE BUG: one cache shared by every request


class GlobalReuseInterceptor:
    """Reuses the previous denoise prediction on odd steps, keeping it in a module global (wrong)."""

    plugin_id = "reuse"

    def before(self, state: LoopState, plan: WorkPlan) -> StepResult | None:
        if plan.kind is WorkUnitKind.DIFFUSION_STEP and state.step % 2 == 1 and "v" in _LAST_PREDICTION:
            return StepResult({"v": _LAST_PREDICTION["v"]})
        return None

    def after(self, state: LoopState, plan: WorkPlan, result: StepResult) -> StepResult:
        if plan.kind is WorkUnitKind.DIFFUSION_STEP:
            _LAST_PREDICTION["v"] = result.outputs["v"]
        return result


class PerRequestReuseInterceptor:
    """The same step skip with its state in LoopState.plugin_state (right)."""

    plugin_id = "reuse"

    def before(self, state: LoopState, plan: WorkPlan) -> StepResult | None:
        slot = plugin_slot(state, self.plugin_id)
        if plan.kind is WorkUnitKind.DIFFUSION_STEP and state.step % 2 == 1 and "v" in slot:
            return StepResult({"v": slot["v"]})
        return None

    def after(self, state: LoopState, plan: WorkPlan, result: StepResult) -> StepResult:
        if plan.kind is WorkUnitKind.DIFFUSION_STEP:
            plugin_slot(state, self.plugin_id)["v"] = result.outputs["v"]
        return result
