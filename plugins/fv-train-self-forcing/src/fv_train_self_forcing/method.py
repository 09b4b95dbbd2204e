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
(:mod:`fv_train_self_forcing.losses`); the critic is updated every trainer step, the student every
``critic_steps_per_generator``-th (TTUR), followed by an **EMA** update; the EMA is what is exported.

Every forward runs the family's serve bodies through its training adapter (``train_adapter``): the
student's chunk passes are the causal loop's chunk body over a context gathered the way the loop
gathers it from its KV pool (C2-free, bit for bit; tested). No family plugin is imported.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Protocol, cast

import torch

import fv_core
from fv_core import ConfigError
from fv_core.training import (
    Consistency,
    MethodSpec,
    Role,
    RoleSpec,
    TrainAdapter,
    TrainConfig,
    load_optimizer,
    make_optimizer,
    read_prompts,
    save_optimizer,
    set_lr,
    train_adapter,
    validate_options,
)
from fv_train_self_forcing.config import SelfForcingOptions
from fv_train_self_forcing.losses import dm_loss, draw_sigmas, flow_loss, noised

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


class SelfForcingMethod:
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
        self.cfg, self.opts = cfg, validate_options(SelfForcingOptions, cfg.options, "self_forcing")
        torch.manual_seed(cfg.seed)
        self.prompts = read_prompts(self.opts.prompts)
        model = fv_core.load(self.opts.teacher, self.opts.teacher_weights)
        self.teacher_defaults = model.prepare({"prompt": "-"}).params
        self.adapter = self._causal(train_adapter(model), model.card.family)
        self.timesteps, self.sigmas = self.adapter.causal_schedule(self.opts.timesteps, self.opts.flow_shift)
        n = self.adapter.num_train_timesteps
        # the finished chunk's noise level and model timestep in its cache write (the loop's arithmetic)
        c, shift = self.opts.context_timestep / n, self.opts.flow_shift
        self.context_sigma = shift * c / (1 + (shift - 1) * c)
        self.context_timestep = self.context_sigma * n
        self.num_frames = self.opts.num_frames or self.teacher_defaults.num_frames
        self._check_frames()
        teacher = self.adapter.module("transformer").requires_grad_(False).eval()
        self.adapter.module("text_encoder").requires_grad_(False).eval()
        student = copy.deepcopy(teacher)
        if self.opts.student_weights is not None:
            start = fv_core.load(self.opts.teacher, self.opts.student_weights).instance.component(
                "transformer"
            )
            student.load_state_dict(start.state_dict())
        self.roles: dict[Role, dict[str, torch.nn.Module]] = {
            Role.TEACHER: {"transformer": teacher},
            Role.STUDENT: {"transformer": student.requires_grad_(True)},
            Role.EMA: {"transformer": copy.deepcopy(student).requires_grad_(False).eval()},
            Role.CRITIC: {"transformer": copy.deepcopy(teacher).requires_grad_(True)},
        }
        self.opt_g = make_optimizer(list(self.student.parameters()), cfg.optim)
        self.critic_optim = cfg.optim.model_copy(update={"lr": self.opts.critic_lr or cfg.optim.lr})
        self.opt_c = make_optimizer(list(self.critic.parameters()), self.critic_optim)
        with torch.no_grad():  # the frozen text encoder: every prompt's embeddings once
            self.embeds = self.adapter.conditioning(self.prompts)
            self.uncond = self.adapter.conditioning([""]) if self.opts.real_guidance > 1 else None
        self._last_g: dict[str, float] = {}

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

    @property
    def student(self) -> torch.nn.Module:
        return self.roles[Role.STUDENT]["transformer"]

    @property
    def ema(self) -> torch.nn.Module:
        return self.roles[Role.EMA]["transformer"]

    @property
    def critic(self) -> torch.nn.Module:
        return self.roles[Role.CRITIC]["transformer"]

    @property
    def teacher(self) -> torch.nn.Module:
        return self.roles[Role.TEACHER]["transformer"]

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

    # ---- scores (bidirectional, on whole videos) ----

    def real_x0(self, x: torch.Tensor, sigma: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        v = self.adapter.velocity(self.teacher, x, sigma, embeds)
        if self.uncond is not None:
            v_u = self.adapter.velocity(self.teacher, x, sigma, self.uncond.expand_as(embeds))
            v = v_u + self.opts.real_guidance * (v - v_u)
        return x - sigma.view(-1, 1, 1, 1, 1) * v

    def fake_x0(self, x: torch.Tensor, sigma: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        return x - sigma.view(-1, 1, 1, 1, 1) * self.adapter.velocity(self.critic, x, sigma, embeds)

    def _sigmas(self, n: int, gen: torch.Generator) -> torch.Tensor:
        return draw_sigmas(n, self.opts.min_sigma, self.opts.max_sigma, self.opts.shift, gen)

    def generator_loss(
        self, video: torch.Tensor, embeds: torch.Tensor, gen: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        sigma = self._sigmas(video.shape[0], gen)
        with torch.no_grad():
            noisy = noised(video.detach(), sigma, torch.randn(video.shape, generator=gen))
            real, fake = self.real_x0(noisy, sigma, embeds), self.fake_x0(noisy, sigma, embeds)
        return dm_loss(video, real, fake)

    def critic_loss(
        self,
        video: torch.Tensor,
        embeds: torch.Tensor,
        gen: torch.Generator,
        sigma: torch.Tensor | None = None,
    ) -> torch.Tensor:
        sigma = self._sigmas(video.shape[0], gen) if sigma is None else sigma
        noise = torch.randn(video.shape, generator=gen)
        velocity = self.adapter.velocity(self.critic, noised(video, sigma, noise), sigma, embeds, train=True)
        return flow_loss(velocity, video, noise)

    # ---- the step ----

    def step(self, step: int) -> dict[str, float]:
        gen = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + step)  # per step: resume is exact
        embeds = self.embeds[torch.randint(len(self.prompts), (self.cfg.batch_size,), generator=gen)]
        self.student.train()
        self.critic.train()
        ratio = self.opts.critic_steps_per_generator
        if step % ratio == 0:
            video = self.generator_step(step // ratio, embeds, gen)
        else:
            with torch.no_grad():
                video = self.sample(embeds, gen, grad=False)
        lr_c = set_lr(self.opt_c, self.critic_optim, step, self.cfg.steps)
        loss_c = self.critic_loss(video, embeds, gen)
        self.opt_c.zero_grad(set_to_none=True)
        loss_c.backward()
        norm_c = torch.nn.utils.clip_grad_norm_(self.critic.parameters(), self.cfg.optim.grad_clip)
        self.opt_c.step()
        return {
            "loss": loss_c.item(),
            "loss_critic": loss_c.item(),
            "grad_norm_c": norm_c.item(),
            "lr_c": lr_c,
            **self._last_g,
        }

    def generator_step(self, update: int, embeds: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """One student update on its own rollout, then the EMA; returns the (detached) video."""
        total = -(-self.cfg.steps // self.opts.critic_steps_per_generator)
        lr_g = set_lr(self.opt_g, self.cfg.optim, update, total)
        video = self.sample(embeds, gen, grad=True)
        self.critic.requires_grad_(False)
        loss_g, grad_mag = self.generator_loss(video, embeds, gen)
        self.critic.requires_grad_(True)
        self.opt_g.zero_grad(set_to_none=True)
        loss_g.backward()
        norm_g = torch.nn.utils.clip_grad_norm_(self.student.parameters(), self.cfg.optim.grad_clip)
        self.opt_g.step()
        self.update_ema(0.0 if update < self.opts.ema_start else self.opts.ema_decay)
        self._last_g = {
            "loss_dm": loss_g.item(),
            "dm_grad": grad_mag.item(),
            "grad_norm_g": norm_g.item(),
            "lr_g": lr_g,
        }
        return video.detach()

    @torch.no_grad()
    def update_ema(self, decay: float) -> None:
        """``ema = decay * ema + (1 - decay) * student`` (a copy at decay 0)."""
        for e, s in zip(self.ema.parameters(), self.student.parameters(), strict=True):
            e.lerp_(s.detach(), 1 - decay)

    # ---- evaluation ----

    @torch.no_grad()
    def evaluate(self, step: int) -> dict[str, float]:
        """The EMA's full causal rollout (every chunk to its last step, as served) on fixed prompts and
        noise; at fixed noise levels the critic's flow loss on it and the relative fake/real gap
        ``mean|fake - real| / mean|x0 - real|`` (0 when the critic cannot tell it from the teacher's)."""
        self.critic.eval()
        gen = torch.Generator().manual_seed(12345)
        count = min(self.opts.eval_prompts, len(self.prompts))
        embeds = self.embeds[torch.linspace(0, len(self.prompts) - 1, count).round().long()]
        noise = self.adapter.noise(count, gen, num_frames=self.num_frames)
        last = [len(self.opts.timesteps) - 1] * (noise.shape[2] // self.opts.chunk_frames)
        video = self.rollout(self.ema, embeds, noise, gen, last, grad=False)
        metrics: dict[str, float] = {"x0_std": video.std().item()}
        for value in self.opts.eval_sigmas:
            sigma = torch.full((count,), value)
            noisy = noised(video, sigma, torch.randn(video.shape, generator=gen))
            real, fake = self.real_x0(noisy, sigma, embeds), self.fake_x0(noisy, sigma, embeds)
            metrics[f"dm_gap@{value}"] = ((fake - real).abs().mean() / (video - real).abs().mean()).item()
            metrics[f"critic_loss@{value}"] = self.critic_loss(video, embeds, gen, sigma).item()
        return metrics

    # ---- checkpoints ----

    def save(self, folder: Path) -> None:
        """``folder`` is itself the exported EMA student (loadable), plus ``student/transformer``,
        ``critic/transformer`` and both optimisers' state."""
        self.export(folder)
        for role, module in (("student", self.student), ("critic", self.critic)):
            saved: Any = module  # a diffusers model: save_pretrained / from_pretrained
            saved.save_pretrained(folder / role / "transformer", safe_serialization=True)
        save_optimizer(self.opt_g, folder / "generator_optimizer.safetensors")
        save_optimizer(self.opt_c, folder / "critic_optimizer.safetensors")

    def load(self, folder: Path) -> None:
        pairs = ((self.ema, folder), (self.student, folder / "student"), (self.critic, folder / "critic"))
        for module, root in pairs:
            cls: Any = type(module)  # a diffusers model class
            saved = cls.from_pretrained(root / "transformer", use_safetensors=True)
            module.load_state_dict(saved.state_dict())
        load_optimizer(self.opt_g, folder / "generator_optimizer.safetensors")
        load_optimizer(self.opt_c, folder / "critic_optimizer.safetensors")

    def recipe(self) -> dict[str, Any]:
        t, o = self.teacher_defaults, self.opts
        return {
            "method": "self_forcing",
            "parents": [o.teacher],
            "teacher": {
                "card": o.teacher,
                "weights": str(o.teacher_weights) if o.teacher_weights else None,
                "steps": t.num_inference_steps,
                "guidance": t.guidance_scale,
                "sampler": getattr(t, "sampler", None),
            },
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
            "exported": "ema",
            "train_steps": self.cfg.steps,
            "batch_size": self.cfg.batch_size,
        }

    def export(self, folder: Path) -> None:
        """The teacher's checkpoint with the EMA student's transformer, and the recipe."""
        self.adapter.export(folder, {"transformer": self.ema}, self.recipe())
