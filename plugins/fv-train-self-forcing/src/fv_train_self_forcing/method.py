"""The ``self_forcing`` method: Self Forcing (Huang et al. 2025, "Self Forcing: Bridging the Train-Test
Gap in Autoregressive Video Diffusion") on a family's causal loop pieces.

A causal **student** (initialised from the bidirectional teacher's transformer, as CausVid and Self
Forcing start) is trained on its *own* rollouts: the video is made chunk by chunk exactly as the causal
serve loop makes it (each chunk denoised by the fixed few-step schedule over the keys/values of the
student's own earlier chunks, each finished chunk re-run at the context timestep into a rolling
window), so what it learns from is what it will see at inference (no teacher forcing, no exposure
bias). Per chunk one **exit step** is drawn among the fixed steps: the steps before it run without
grad, the exit step's x0 prediction (with grad) is the chunk, the cache write runs without grad.

The whole generated video is then scored against the bidirectional **teacher** (frozen; the real
score) and a **critic** (the fake score, initialised from the teacher, trained with the flow loss on
the student's detached videos): the generator loss is DMD's distribution matching
(the core's DMD toolkit, ``fv_core.training.dmd``); the critic is updated every trainer step, the student every
``critic_steps_per_generator``-th (TTUR), followed by an **EMA** update; the EMA is what is exported.
With ``regression_weight`` the student also regresses onto the teacher's own ODE samples, teacher-forced
chunk by chunk (:meth:`SelfForcingMethod.regression_loss`).

Every forward runs the family's serve bodies through its training adapter (``train_adapter``): the
student's chunk passes are the causal loop's chunk body over a context gathered the way the loop
gathers it from its KV pool (C2-free, bit for bit; tested). No family plugin is imported.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, cast

import torch

from fv_core import ConfigError
from fv_core.training import (
    Consistency,
    DistributionMatching,
    MethodSpec,
    Role,
    RoleSpec,
    TrainAdapter,
    TrainConfig,
    train_adapter,
)
from fv_train_self_forcing.config import SelfForcingOptions

TRANSFORMER = ("transformer",)
CAUSAL_API = ("causal_schedule", "text_kv", "chunk_context", "chunk_velocity")


class CausalTrainAdapter(TrainAdapter, Protocol):
    """A training adapter that also offers its family's causal loop pieces (fv-wan's does)."""

    def causal_schedule(self, fixed: list[int], shift: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Every chunk's model timesteps [steps] and sigmas [steps + 1], as the causal loop derives them."""
        ...

    def text_kv(
        self, transformer: torch.nn.Module, embeds: torch.Tensor, train: bool = False
    ) -> torch.Tensor:
        """The prompt's cross-attention keys/values as the loop computes them."""
        ...

    def chunk_context(
        self, transformer: torch.nn.Module, latents: torch.Tensor, window: int, sink: int
    ) -> Any:
        """An empty rolling window of keys/values (``write(k, v, first_frame)`` appends a chunk)."""
        ...

    def chunk_velocity(
        self,
        transformer: torch.nn.Module,
        latents: torch.Tensor,
        timestep: float,
        kv: torch.Tensor,
        context: Any,
        first_frame: int,
        train: bool = False,
    ) -> dict[str, torch.Tensor]:
        """One chunk pass of the causal loop's body over ``context``: velocity, k, v."""
        ...


def renoise(x0: torch.Tensor, sigma: float, gen: torch.Generator) -> torch.Tensor:
    """``x0`` at flow level ``sigma`` with fresh noise (``x0`` itself at 0): the causal loop's re-noise."""
    if sigma == 0:
        return x0
    return (1 - sigma) * x0 + sigma * torch.randn(x0.shape, generator=gen, dtype=x0.dtype)


class SelfForcingMethod(DistributionMatching):
    """Self-forcing of a causal student; see the module docstring."""

    spec = MethodSpec(
        roles=(
            RoleSpec(Role.STUDENT, trains=TRANSFORMER, holds=TRANSFORMER),
            RoleSpec(Role.EMA, holds=TRANSFORMER),
            RoleSpec(Role.TEACHER, holds=("transformer", "text_encoder")),
            RoleSpec(Role.CRITIC, trains=TRANSFORMER, holds=TRANSFORMER),
        ),
        consistency=Consistency.C2_FREE,
        # Data-free: rollouts are simulated in training; these are the fields of the causal card's serve
        # rollout its C2 gate compares: the per-chunk schedule, each chunk pass's inputs (latents,
        # timestep, text K/V, context K/V and mask) and outputs (velocity, K/V), the weights versions.
        record_fields=("schedule", "chunks", "steps.inputs", "steps.outputs", "weights_versions"),
    )

    def __init__(self, cfg: TrainConfig) -> None:
        model = self.load_teacher(cfg, SelfForcingOptions, "self_forcing")
        self.adapter = self._causal(train_adapter(model), model.card.family)
        self.timesteps, self.sigmas = self.adapter.causal_schedule(self.opts.timesteps, self.opts.flow_shift)
        n = self.adapter.num_train_timesteps
        # the finished chunk's noise level and model timestep in its cache write (the loop's arithmetic)
        c, shift = self.opts.context_timestep / n, self.opts.flow_shift
        self.context_sigma = shift * c / (1 + (shift - 1) * c)
        self.context_timestep = self.context_sigma * n
        self.num_frames = self.opts.num_frames or self.teacher_defaults.num_frames
        self._check_frames()
        self.setup_roles()

    def _causal(self, adapter: TrainAdapter, family: str) -> CausalTrainAdapter:
        missing = [name for name in CAUSAL_API if not hasattr(adapter, name)]
        if missing:
            raise ConfigError(
                f"teacher {self.opts.teacher!r}: the training adapter of family {family!r} lacks the causal "
                f"loop pieces {missing} self-forcing rolls out with. Fix: train a family whose adapter "
                "offers them (fv-wan's WanTrainAdapter does)."
            )
        return cast(CausalTrainAdapter, adapter)

    def _check_frames(self) -> None:
        latent = (self.num_frames - 1) // 4 + 1
        if latent % self.opts.chunk_frames:
            raise ConfigError(
                f"num_frames={self.num_frames} makes {latent} latent frames, not a multiple of "
                f"chunk_frames={self.opts.chunk_frames}. Fix: set options.num_frames so that "
                "(num_frames - 1) / 4 + 1 is a multiple of chunk_frames"
            )

    # ---- the self-forcing rollout (the causal serve loop's order of passes and noise draws) ----

    def rollout(
        self,
        transformer: torch.nn.Module,
        embeds: torch.Tensor,
        noise: torch.Tensor,
        gen: torch.Generator,
        exits: list[int],
        grad: bool,
    ) -> torch.Tensor:
        """The video latents [B, C, F, H, W] of ``transformer`` rolled out chunk by chunk from ``noise``:
        chunk ``c`` runs the fixed steps up to ``exits[c]`` (re-noising with ``gen`` between them) and is
        that step's x0 prediction, computed with grad when ``grad`` (every other pass without); each
        finished chunk but the last is written into the rolling context at the context timestep. With
        every exit at the last step this is the causal loop's own rollout."""
        n, out = self.opts.chunk_frames, []
        kv = self.adapter.text_kv(transformer, embeds, train=grad)
        ctx = self.adapter.chunk_context(transformer, noise, self.opts.window_frames, self.opts.sink_frames)
        chunks = noise.shape[2] // n
        for c in range(chunks):
            x = noise[:, :, c * n : (c + 1) * n]
            for i in range(exits[c] + 1):
                last = i == exits[c]
                train = grad and last
                with torch.set_grad_enabled(train):
                    v = self.adapter.chunk_velocity(
                        transformer,
                        x,
                        float(self.timesteps[i]),
                        kv if train else kv.detach(),
                        ctx,
                        c * n,
                        train,
                    )["velocity"]
                    x0 = x - self.sigmas[i] * v.float()
                if not last:
                    x = renoise(x0, float(self.sigmas[i + 1]), gen)
            out.append(x0)
            if c < chunks - 1:  # the cache write: the clean chunk at the context timestep, no grad
                context = renoise(x0.detach(), self.context_sigma, gen)
                kv_write = self.adapter.chunk_velocity(
                    transformer, context, self.context_timestep, kv.detach(), ctx, c * n, False
                )
                ctx.write(kv_write["k"], kv_write["v"], c * n)
        return torch.cat(out, 2)

    def sample(self, embeds: torch.Tensor, gen: torch.Generator, grad: bool) -> torch.Tensor:
        """A generated video: the student's rollout from fresh noise with a random exit step per chunk."""
        noise = self.adapter.noise(embeds.shape[0], gen, num_frames=self.num_frames)
        chunks = noise.shape[2] // self.opts.chunk_frames
        exits = torch.randint(len(self.opts.timesteps), (chunks,), generator=gen).tolist()
        return self.rollout(self.student, embeds, noise, gen, exits, grad)

    # ---- the regression onto the teacher's ODE (options.regression_weight) ----

    def regression_loss(self, embeds: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """Mean squared error of the student's x0 against the teacher's sample, per chunk at a random fixed
        step, teacher-forced: the context holds the teacher's earlier chunks, written as the loop writes."""
        n, student = self.opts.chunk_frames, self.student
        noise = self.adapter.noise(embeds.shape[0], gen, num_frames=self.num_frames)
        target = self.teacher_sample(noise, embeds)
        kv = self.adapter.text_kv(student, embeds, train=True)
        ctx = self.adapter.chunk_context(student, noise, self.opts.window_frames, self.opts.sink_frames)
        chunks = noise.shape[2] // n
        steps = torch.randint(len(self.opts.timesteps), (chunks,), generator=gen).tolist()
        losses = []
        for c, i in enumerate(steps):
            frames = slice(c * n, (c + 1) * n)
            clean = target[:, :, frames]
            x = noise[:, :, frames] if i == 0 else renoise(clean, float(self.sigmas[i]), gen)
            v = self.adapter.chunk_velocity(student, x, float(self.timesteps[i]), kv, ctx, c * n, True)
            losses.append(torch.nn.functional.mse_loss(x - self.sigmas[i] * v["velocity"].float(), clean))
            if c < chunks - 1:
                with torch.no_grad():
                    context = renoise(clean, self.context_sigma, gen)
                    write = self.adapter.chunk_velocity(
                        student, context, self.context_timestep, kv.detach(), ctx, c * n, False
                    )
                ctx.write(write["k"], write["v"], c * n)
        return torch.stack(losses).mean()

    # ---- evaluation ----

    @torch.no_grad()
    def evaluate(self, step: int) -> dict[str, float]:
        """The EMA's full causal rollout (every chunk to its last step, as served) on fixed prompts and
        noise, then the DMD gap at fixed noise levels."""
        self.critic.eval()
        gen = torch.Generator().manual_seed(12345)
        embeds = self.eval_embeds()
        noise = self.adapter.noise(embeds.shape[0], gen, num_frames=self.num_frames)
        last = [len(self.opts.timesteps) - 1] * (noise.shape[2] // self.opts.chunk_frames)
        return self.dm_gap(self.rollout(self.ema, embeds, noise, gen, last, grad=False), embeds, gen)

    # ---- checkpoints ----

    def save(self, folder: Path) -> None:
        """``folder`` is itself the exported EMA student (loadable), plus ``student/transformer``,
        ``critic/transformer`` and both optimisers' state."""
        self.export(folder)
        self.save_state(folder, {"student": self.student, "critic": self.critic})

    def load(self, folder: Path) -> None:
        self.load_state(folder, {"": self.ema, "student": self.student, "critic": self.critic})

    def recipe(self) -> dict[str, Any]:
        o = self.opts
        return {
            "method": "self_forcing",
            "parents": [o.teacher],
            "teacher": self.teacher_recipe(),
            "student_init": str(o.student_weights) if o.student_weights else "teacher",
            "loop": "causal",
            "timesteps": list(o.timesteps),
            "flow_shift": o.flow_shift,
            "chunk_frames": o.chunk_frames,
            "context_timestep": o.context_timestep,
            "window_frames": o.window_frames,
            "sink_frames": o.sink_frames,
            "num_frames": self.num_frames,
            "sampler": "dmd",
            "guidance": 1.0,
            "real_guidance": o.real_guidance,
            "critic_steps_per_generator": o.critic_steps_per_generator,
            "ema_decay": o.ema_decay,
            "regression_weight": o.regression_weight,
            "regression_steps": o.regression_steps,
            "exported": "ema",
            "train_steps": self.cfg.steps,
            "steps_done": self.steps_done,
            "batch_size": self.cfg.batch_size,
        }

    def export(self, folder: Path) -> None:
        """The teacher's checkpoint with the EMA student's transformer, and the recipe."""
        self.adapter.export(folder, {"transformer": self.ema}, self.recipe())
