"""Flow-matching samplers Wan ships with, written as stateless math.

Each sampler's per-request history (UniPC keeps past model outputs) lives in
the ``tensors``/``values`` dicts the caller passes in, i.e. in ``LoopState``;
nothing is kept on a shared object. Schedules and updates reproduce diffusers'
``UniPCMultistepScheduler`` (flow sigmas) and ``FlowMatchEulerDiscreteScheduler``
to float32 rounding.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fv_core import ConfigError


@dataclass(frozen=True, slots=True)
class Schedule:
    """The timesteps a denoise loop visits."""

    timesteps: torch.Tensor  # [steps], what the transformer is conditioned on
    sigmas: torch.Tensor  # [steps + 1] float32 noise levels, ending at the final sigma


def _shift(sigmas, shift: float):
    return shift * sigmas / (1 + (shift - 1) * sigmas)


class UniPC:
    """UniPC multistep (B(h) predictor-corrector) on flow sigmas with flow shift, x0-prediction."""

    name = "unipc"
    prefix = "unipc."  # key prefix in LoopState.tensors / values

    def __init__(self, config: dict[str, Any]):
        if not config.get("use_flow_sigmas") or config.get("prediction_type") != "flow_prediction":
            raise ConfigError(
                f"sampler 'unipc' needs a flow-mode scheduler config (use_flow_sigmas=true, "
                f"prediction_type='flow_prediction'); got {config.get('use_flow_sigmas')!r}, "
                f"{config.get('prediction_type')!r}. Fix: use the scheduler_config.json Wan ships."
            )
        if config.get("solver_type", "bh2") not in ("bh1", "bh2") or not config.get("predict_x0", True):
            raise ConfigError("sampler 'unipc' supports solver_type bh1/bh2 with predict_x0=true only")
        self.train_steps = int(config.get("num_train_timesteps", 1000))
        self.shift = float(config.get("flow_shift", 1.0))
        self.order = int(config.get("solver_order", 2))
        self.lower_order_final = bool(config.get("lower_order_final", True))
        self.bh2 = config.get("solver_type", "bh2") == "bh2"
        self.final_zero = config.get("final_sigmas_type", "zero") == "zero"
        self.no_corrector = set(config.get("disable_corrector") or [])

    def schedule(self, steps: int) -> Schedule:
        sigmas = _shift(np.linspace(1, 1 / self.train_steps, steps + 1)[:-1], self.shift)
        if abs(sigmas[0] - 1) < 1e-6:
            sigmas[0] -= 1e-6  # keeps log(sigma) finite on the first update
        timesteps = torch.from_numpy(sigmas * self.train_steps).to(torch.int64)
        last = 0.0 if self.final_zero else sigmas[-1]
        return Schedule(timesteps, torch.from_numpy(np.concatenate([sigmas, [last]]).astype(np.float32)))

    def step(
        self,
        tensors: dict,
        values: dict,
        sched: Schedule,
        i: int,
        velocity: torch.Tensor,
        sample: torch.Tensor,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """One UniC correction of ``sample`` (from step ``i - 1``) then one UniP prediction to ``i + 1``."""
        p = self.prefix
        sigmas = tuple(sched.sigmas.tolist())  # the float32 sigmas as exact Python scalars
        history = [tensors[f"{p}m{k}"] for k in range(values.get(f"{p}n", 0))]  # x0 predictions, oldest first
        x0 = sample - sigmas[i] * velocity
        if i > 0 and (i - 1) not in self.no_corrector and f"{p}last" in tensors:
            sample = self._correct(sigmas, i, history, x0, tensors[f"{p}last"], sample, values[f"{p}order"])
        history = [*history, x0][-self.order :]
        order = min(self.order, len(sched.timesteps) - i) if self.lower_order_final else self.order
        order = min(order, values.get(f"{p}warm", 0) + 1)
        prev = self._predict(sigmas, i, history, sample, order)
        for k, m in enumerate(history):
            tensors[f"{p}m{k}"] = m
        tensors[f"{p}last"] = sample
        values.update(
            {
                f"{p}n": len(history),
                f"{p}order": order,
                f"{p}warm": min(values.get(f"{p}warm", 0) + 1, self.order),
            }
        )
        return prev

    def _terms(
        self, sigmas: tuple[float, ...], t: int, s0: int, earlier: list[int], order: int, correct: bool
    ):
        """The step's scalar terms (a function of the schedule alone, so computed once per schedule)."""
        return _bh_terms(sigmas, t, s0, tuple(earlier), order, self.bh2, correct)

    @staticmethod
    def _residual(history, rks: tuple[torch.Tensor, ...], rhos: tuple[torch.Tensor, ...], x: torch.Tensor):
        """sum_k rho_k D1_k, D1_k the k-th earlier x0 prediction's difference from the latest over r_k;
        0 without earlier predictions."""
        m0 = history[-1]
        d1s = [(history[-(k + 2)] - m0) / rk for k, rk in enumerate(rks)]
        if len(d1s) <= 1:  # one term: the product einsum rounds to, without its dispatch
            return rhos[0] * d1s[0] if d1s else 0
        return torch.einsum("k,bkc...->bc...", torch.stack(rhos).to(x), torch.stack(d1s, dim=1).to(x))

    def _predict(self, sigmas, i: int, history, x: torch.Tensor, order: int) -> torch.Tensor:
        earlier = [i - k for k in range(1, order)]
        base, alpha_h_phi_1, alpha_b_h, rks, rhos = self._terms(sigmas, i + 1, i, earlier, order, False)
        res = self._residual(history, rks, rhos, x)
        x_t = base * x - alpha_h_phi_1 * history[-1] - alpha_b_h * res
        return x_t.to(x.dtype)

    def _correct(
        self, sigmas, i: int, history, x0: torch.Tensor, last: torch.Tensor, x: torch.Tensor, order: int
    ) -> torch.Tensor:
        earlier = [i - (k + 1) for k in range(1, order)]
        base, alpha_h_phi_1, alpha_b_h, rks, rhos = self._terms(sigmas, i, i - 1, earlier, order, True)
        res = self._residual(history, rks, rhos[:-1], x)
        x_t = base * last - alpha_h_phi_1 * history[-1] - alpha_b_h * (res + rhos[-1] * (x0 - history[-1]))
        return x_t.to(x.dtype)


@functools.lru_cache(maxsize=8192)
def _bh_terms(
    sigma_values: tuple[float, ...],
    t: int,
    s0: int,
    earlier: tuple[int, ...],
    order: int,
    bh2: bool,
    correct: bool,
) -> tuple[Any, ...]:
    """UniPC's B(h) terms of the update from ``s0`` to ``t``, float32 0-d tensors: sigma_t / sigma_s0,
    alpha_t * h_phi_1, alpha_t * B(h), the r_k of the earlier steps and the rho solution (the
    corrector's, or the predictor's). The same float32 arithmetic as diffusers' scheduler, so results
    match it bit for bit; read-only (shared)."""
    sigmas = torch.tensor(sigma_values, dtype=torch.float32)
    lam = lambda s: torch.log(1 - s) - torch.log(s)  # noqa: E731 - log-SNR of a flow sigma
    alpha_t, sigma_t, sigma_s0 = 1 - sigmas[t], sigmas[t], sigmas[s0]
    h = lam(sigmas[t]) - lam(sigmas[s0])
    rks = [(lam(sigmas[earlier[k - 1]]) - lam(sigmas[s0])) / h for k in range(1, order)]
    hh = -h
    h_phi_1 = torch.expm1(hh)
    h_phi_k = h_phi_1 / hh - 1
    b_h = torch.expm1(hh) if bh2 else hh
    powers = torch.stack([*rks, torch.ones(())])
    rows, b, factorial = [], [], 1
    for k in range(1, order + 1):
        rows.append(torch.pow(powers, k - 1))
        b.append(h_phi_k * factorial / b_h)
        factorial *= k + 1
        h_phi_k = h_phi_k / hh - 1 / factorial
    r, bb = torch.stack(rows), torch.stack(b)
    if correct:
        rhos = torch.ones(1) * 0.5 if order == 1 else torch.linalg.solve(r, bb)
    elif order == 1:  # the predictor's first-order update has no correction terms
        rhos = torch.zeros(0)
    else:
        rhos = torch.ones(1) * 0.5 if order == 2 else torch.linalg.solve(r[:-1, :-1], bb[:-1])
    scalars = (sigma_t / sigma_s0, alpha_t * h_phi_1, alpha_t * b_h)
    return (*scalars, tuple(rks), tuple(rhos.unbind()))


class FlowEuler:
    """Flow-match Euler: ``x <- x + (sigma_next - sigma) * v`` on shifted sigmas (``shift_terminal`` too)."""

    name = "euler"
    UNSUPPORTED = (  # FlowMatchEulerDiscreteScheduler options that change the schedule and are not reproduced
        "use_dynamic_shifting",
        "use_karras_sigmas",
        "use_exponential_sigmas",
        "use_beta_sigmas",
        "invert_sigmas",
        "stochastic_sampling",
    )

    def __init__(self, config: dict[str, Any]):
        used = [k for k in self.UNSUPPORTED if config.get(k)]
        if used:
            raise ConfigError(
                f"sampler 'euler' does not reproduce the scheduler options {used} of this checkpoint's "
                "scheduler_config.json (Wan's pipeline does not use them). Fix: set them to false in the "
                "scheduler config, or use a checkpoint with Wan's own scheduler config."
            )
        self.train_steps = int(config.get("num_train_timesteps", 1000))
        self.shift = float(config.get("flow_shift", config.get("shift", 1.0)))
        self.terminal = config.get("shift_terminal")

    def schedule(self, steps: int) -> Schedule:
        n = self.train_steps
        # diffusers shifts its training sigmas in float32 to find the range, then shifts the range again
        ends = _shift(torch.tensor([float(n), 1.0]) / n, self.shift)
        t = np.linspace(ends[0].item() * n, ends[1].item() * n, steps)
        sigmas = _shift(t / n, self.shift)
        if self.terminal:  # stretch so the last sigma is shift_terminal
            sigmas = 1 - (1 - sigmas) / ((1 - sigmas[-1]) / (1 - self.terminal))
        sigmas = torch.from_numpy(sigmas).to(torch.float32)
        return Schedule(sigmas * n, torch.cat([sigmas, torch.zeros(1)]))

    def step(
        self,
        tensors: dict,
        values: dict,
        sched: Schedule,
        i: int,
        velocity: torch.Tensor,
        sample: torch.Tensor,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        dt = sched.sigmas[i + 1] - sched.sigmas[i]
        return (sample.to(torch.float32) + dt * velocity).to(velocity.dtype)


class FixedDMD:
    """Few-step DMD sampling at pinned timesteps: predict x0, re-noise to the next timestep with fresh noise."""

    name = "dmd"

    def __init__(self, config: dict[str, Any], timesteps: list[int]):
        self.train_steps = int(config.get("num_train_timesteps", 1000))
        self.fixed = list(timesteps)

    def schedule(self, steps: int) -> Schedule:
        if steps != len(self.fixed):
            raise ConfigError(
                f"sampler 'dmd' runs exactly {len(self.fixed)} steps at {self.fixed}; got {steps}"
            )
        sigmas = torch.tensor([*self.fixed, 0], dtype=torch.float32) / self.train_steps
        return Schedule(torch.tensor(self.fixed, dtype=torch.int64), sigmas)

    def step(
        self,
        tensors: dict,
        values: dict,
        sched: Schedule,
        i: int,
        velocity: torch.Tensor,
        sample: torch.Tensor,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        x0 = sample - sched.sigmas[i] * velocity
        nxt = sched.sigmas[i + 1]
        if nxt == 0:
            return x0
        device = generator.device if generator is not None else sample.device  # the request's CPU generator
        noise = torch.randn(sample.shape, generator=generator, dtype=sample.dtype, device=device)
        return (1 - nxt) * x0 + nxt * noise.to(sample.device)


SAMPLERS = {"unipc": UniPC, "euler": FlowEuler}


def make_sampler(name: str, config: dict[str, Any], fixed_timesteps: list[int] | None = None):
    """The sampler ``name`` for a checkpoint's scheduler config; ``dmd`` needs the card's fixed timesteps."""
    if name == "dmd" and fixed_timesteps:
        return FixedDMD(config, fixed_timesteps)
    if name not in SAMPLERS:
        raise ConfigError(f"unknown sampler {name!r}. Fix: use one of {sorted([*SAMPLERS, 'dmd'])}")
    return SAMPLERS[name](config)


# ---- causal Wan's few-step schedule, run per chunk (fv_wan.causal_loop) ----


def shifted(timestep: float, shift: float, train_steps: int = 1000) -> float:
    """A timestep under the flow shift, as a noise level sigma in 0..1."""
    s = timestep / train_steps
    return shift * s / (1 + (shift - 1) * s)


def chunk_schedule(
    fixed: list[int], shift: float, train_steps: int = 1000
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed denoise timesteps of every chunk under the flow shift: the model's timesteps [steps]
    and the sigmas [steps + 1] ending at 0 (Self-Forcing's warped few-step list)."""
    sigmas = torch.tensor([shifted(t, shift, train_steps) for t in fixed] + [0.0], dtype=torch.float32)
    return sigmas[:-1] * train_steps, sigmas


def renoise(x0: torch.Tensor, sigma: float, generator: torch.Generator | None) -> torch.Tensor:
    """``x0`` noised to flow level ``sigma`` with fresh noise from the request's generator (x0 at 0)."""
    if sigma == 0:
        return x0
    noise = torch.randn(x0.shape, generator=generator, dtype=x0.dtype).to(x0.device)  # a CPU generator
    return (1 - sigma) * x0 + sigma * noise
