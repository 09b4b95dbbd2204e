"""The ``dmd2`` method: Distribution Matching Distillation v2 (Yin et al. 2024, "Improved
Distribution Matching Distillation for Fast Image Synthesis") on a family's serve step bodies.

Three copies of the teacher's transformer: the **teacher** (frozen; the real score), the **critic**
(the fake score, initialised from the teacher and trained with the flow denoising loss on the
student's detached outputs, so it tracks the student's output distribution) and the **student**
(initialised from the teacher, sampled at fixed ``timesteps``: predict x0, re-noise to the next
timestep with fresh noise, as the serving ``dmd`` sampler does). The text encoder is the teacher's,
frozen and shared (the student card ships only its transformer).

Per trainer step (one critic update; the generator is updated on every ``critic_steps_per_generator``-th
step first, TTUR):

* backward simulation: draw a step index k of the student's schedule, run the student's own rollout
  (no grad) from noise through steps 0..k-1, re-noising between steps, to get its input at step k;
  the student's x0 prediction at step k (with grad) is the generated sample;
* generator (distribution matching) loss: noise the sample to a random level sigma, take the x0
  predictions of the critic (fake) and the teacher (real, CFG ``real_guidance``); the gradient on the
  sample is ``(fake - real) / mean|sample - real|`` (per sample), applied as
  ``0.5 * ||sample - sg(sample - grad)||^2``;
* critic loss: flow matching (velocity target ``noise - x0``) on the detached sample at a random level.

The GAN term of DMD2 (a classifier head on the critic's features) is not implemented.

Every forward runs the family's serve loop bodies through its training adapter
(``fv_core.training.train_adapter``): the student trains on exactly the forward its card serves
(consistency C2-free, checked by the tests). No family plugin is imported.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

import fv_core
from fv_core import ConfigError
from fv_core.training import (
    Consistency,
    MethodSpec,
    Role,
    RoleSpec,
    TrainConfig,
    load_optimizer,
    make_optimizer,
    read_prompts,
    save_optimizer,
    set_lr,
    train_adapter,
    validate_options,
)
from fv_train_dmd2.config import DMD2Options

TRANSFORMER = ("transformer",)


class DMD2Method:
    """DMD2 distillation; see the module docstring."""

    spec = MethodSpec(
        roles=(
            RoleSpec(Role.STUDENT, trains=TRANSFORMER, holds=TRANSFORMER),
            RoleSpec(Role.TEACHER, holds=("transformer", "text_encoder")),
            RoleSpec(Role.CRITIC, trains=TRANSFORMER, holds=TRANSFORMER),
        ),
        consistency=Consistency.C2_FREE,
        # Training simulates its own rollouts (data-free); these are the BehaviorRecord fields of the
        # student card's serve rollout its C2 gate compares: the fixed schedule, each step's inputs
        # (latents, timestep, text K/V) and prediction (velocity), on the recorded weights.
        record_fields=("schedule", "steps.inputs", "steps.outputs", "weights_versions"),
    )

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg, self.opts = cfg, validate_options(DMD2Options, cfg.options, "dmd2")
        torch.manual_seed(cfg.seed)
        self.prompts = read_prompts(self.opts.prompts)
        model = fv_core.load(self.opts.teacher, self.opts.teacher_weights)
        self.teacher_defaults = model.prepare({"prompt": "-"}).params
        self.adapter = train_adapter(model)
        n = self.adapter.num_train_timesteps
        if max(self.opts.timesteps) > n:
            raise ConfigError(
                f"options.timesteps={self.opts.timesteps} exceed the teacher's num_train_timesteps={n}. "
                f"Fix: use timesteps in (0, {n}]"
            )
        # sigma_k = t_k / n and a final 0: the serving ``dmd`` sampler's schedule, float32
        self.sigmas = torch.tensor([*self.opts.timesteps, 0], dtype=torch.float32) / n
        teacher = self.adapter.module("transformer").requires_grad_(False).eval()
        self.adapter.module("text_encoder").requires_grad_(False).eval()
        self.roles: dict[Role, dict[str, torch.nn.Module]] = {
            Role.TEACHER: {"transformer": teacher},
            Role.STUDENT: {"transformer": copy.deepcopy(teacher).requires_grad_(True)},
            Role.CRITIC: {"transformer": copy.deepcopy(teacher).requires_grad_(True)},
        }
        self.opt_g = make_optimizer(list(self.student.parameters()), cfg.optim)
        critic_optim = cfg.optim.model_copy(update={"lr": self.opts.critic_lr or cfg.optim.lr})
        self.critic_optim = critic_optim
        self.opt_c = make_optimizer(list(self.critic.parameters()), critic_optim)
        with torch.no_grad():  # the frozen text encoder: every prompt's embeddings once
            self.embeds = self.adapter.conditioning(self.prompts)
            self.uncond = self.adapter.conditioning([""]) if self.opts.real_guidance > 1 else None
        self._last_g: dict[str, float] = {}

    @property
    def student(self) -> torch.nn.Module:
        return self.roles[Role.STUDENT]["transformer"]

    @property
    def critic(self) -> torch.nn.Module:
        return self.roles[Role.CRITIC]["transformer"]

    @property
    def teacher(self) -> torch.nn.Module:
        return self.roles[Role.TEACHER]["transformer"]

    # ---- the student's few-step sampler (the serving ``dmd`` sampler's math) ----

    def student_x0(self, x: torch.Tensor, k: int, embeds: torch.Tensor, train: bool) -> torch.Tensor:
        """The student's x0 prediction at its step ``k`` (input ``x`` at sigma_k)."""
        sigma = self.sigmas[k]
        velocity = self.adapter.velocity(self.student, x, sigma.expand(x.shape[0]), embeds, train)
        return x - sigma * velocity

    def simulate(self, embeds: torch.Tensor, k: int, gen: torch.Generator) -> torch.Tensor:
        """Backward simulation: the student's input at step ``k`` of its own rollout from noise
        (no grad; fresh noise re-noises each x0 prediction to the next timestep)."""
        x = self.adapter.noise(embeds.shape[0], gen)
        with torch.no_grad():
            for i in range(k):
                x0 = self.student_x0(x, i, embeds, train=False)
                nxt = self.sigmas[i + 1]
                x = (1 - nxt) * x0 + nxt * torch.randn(x0.shape, generator=gen)
        return x

    def sample(self, embeds: torch.Tensor, gen: torch.Generator, train: bool) -> torch.Tensor:
        """A generated sample: the student's x0 at a random step of a simulated rollout."""
        k = int(torch.randint(len(self.opts.timesteps), (1,), generator=gen))
        x = self.simulate(embeds, k, gen)
        with torch.set_grad_enabled(train):
            return self.student_x0(x, k, embeds, train)

    def draw_sigmas(self, n: int, gen: torch.Generator) -> torch.Tensor:
        lo, hi, s = self.opts.min_sigma, self.opts.max_sigma, self.opts.shift
        u = lo + (hi - lo) * torch.rand(n, generator=gen)
        return s * u / (1 + (s - 1) * u)

    # ---- scores ----

    def real_x0(self, x: torch.Tensor, sigma: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        v = self.adapter.velocity(self.teacher, x, sigma, embeds)
        if self.uncond is not None:
            v_u = self.adapter.velocity(self.teacher, x, sigma, self.uncond.expand_as(embeds))
            v = v_u + self.opts.real_guidance * (v - v_u)
        return x - sigma.view(-1, 1, 1, 1, 1) * v

    def fake_x0(self, x: torch.Tensor, sigma: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        return x - sigma.view(-1, 1, 1, 1, 1) * self.adapter.velocity(self.critic, x, sigma, embeds)

    def dm_loss(
        self, x0: torch.Tensor, embeds: torch.Tensor, gen: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """DMD2's generator loss on the sample ``x0`` (its value, and the per-sample gradient ratio)."""
        sigma = self.draw_sigmas(x0.shape[0], gen)
        s = sigma.view(-1, 1, 1, 1, 1)
        with torch.no_grad():
            noisy = (1 - s) * x0.detach() + s * torch.randn(x0.shape, generator=gen)
            real, fake = self.real_x0(noisy, sigma, embeds), self.fake_x0(noisy, sigma, embeds)
            weight = (x0.detach() - real).abs().mean(dim=(1, 2, 3, 4), keepdim=True)
            grad = torch.nan_to_num((fake - real) / weight)
        loss = 0.5 * torch.nn.functional.mse_loss(x0, (x0 - grad).detach())
        return loss, grad.abs().mean()

    def critic_loss(
        self, x0: torch.Tensor, embeds: torch.Tensor, gen: torch.Generator, sigma: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Flow matching of the fake score on the student's (detached) samples."""
        sigma = self.draw_sigmas(x0.shape[0], gen) if sigma is None else sigma
        noise = torch.randn(x0.shape, generator=gen)
        s = sigma.view(-1, 1, 1, 1, 1)
        noisy = (1 - s) * x0.detach() + s * noise
        velocity = self.adapter.velocity(self.critic, noisy, sigma, embeds, train=True)
        return torch.nn.functional.mse_loss(velocity, noise - x0.detach())

    # ---- the step ----

    def step(self, step: int) -> dict[str, float]:
        gen = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + step)  # per step: resume is exact
        picks = torch.randint(len(self.prompts), (self.cfg.batch_size,), generator=gen)
        embeds = self.embeds[picks]
        self.student.train()
        self.critic.train()
        ratio = self.opts.critic_steps_per_generator
        x0 = None
        if step % ratio == 0:
            lr_g = set_lr(self.opt_g, self.cfg.optim, step // ratio, -(-self.cfg.steps // ratio))
            x0 = self.sample(embeds, gen, train=True)
            self.critic.requires_grad_(False)
            loss_g, grad_mag = self.dm_loss(x0, embeds, gen)
            self.critic.requires_grad_(True)
            self.opt_g.zero_grad(set_to_none=True)
            loss_g.backward()
            norm_g = torch.nn.utils.clip_grad_norm_(self.student.parameters(), self.cfg.optim.grad_clip)
            self.opt_g.step()
            self._last_g = {
                "loss_dm": loss_g.item(),
                "dm_grad": grad_mag.item(),
                "grad_norm_g": norm_g.item(),
                "lr_g": lr_g,
            }
            x0 = x0.detach()
        if x0 is None:
            x0 = self.sample(embeds, gen, train=False)
        lr_c = set_lr(self.opt_c, self.critic_optim, step, self.cfg.steps)
        loss_c = self.critic_loss(x0, embeds, gen)
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

    # ---- evaluation ----

    @torch.no_grad()
    def evaluate(self, step: int) -> dict[str, float]:
        """On fixed prompts and noise: the student's full rollout, then at fixed noise levels the
        critic's flow loss on it and the relative fake/real gap ``mean|fake - real| / mean|x0 - real|``
        (0 when the critic cannot tell the student's samples from the teacher's)."""
        self.student.eval()
        self.critic.eval()
        gen = torch.Generator().manual_seed(12345)
        count = min(self.opts.eval_prompts, len(self.prompts))
        idx = torch.linspace(0, len(self.prompts) - 1, count).round().long()
        embeds = self.embeds[idx]
        x = self.simulate(embeds, len(self.opts.timesteps) - 1, gen)
        x0 = self.student_x0(x, len(self.opts.timesteps) - 1, embeds, train=False)
        metrics: dict[str, float] = {"x0_std": x0.std().item()}
        for value in self.opts.eval_sigmas:
            sigma = torch.full((count,), value)
            s = sigma.view(-1, 1, 1, 1, 1)
            noisy = (1 - s) * x0 + s * torch.randn(x0.shape, generator=gen)
            real, fake = self.real_x0(noisy, sigma, embeds), self.fake_x0(noisy, sigma, embeds)
            metrics[f"dm_gap@{value}"] = ((fake - real).abs().mean() / (x0 - real).abs().mean()).item()
            metrics[f"critic_loss@{value}"] = self.critic_loss(x0, embeds, gen, sigma).item()
        return metrics

    # ---- checkpoints ----

    def save(self, folder: Path) -> None:
        """``folder`` is itself the exported student (loadable), plus ``critic/transformer`` and both
        optimisers' state."""
        self.export(folder)
        critic: Any = self.critic  # a diffusers model: save_pretrained / from_pretrained
        critic.save_pretrained(folder / "critic" / "transformer", safe_serialization=True)
        save_optimizer(self.opt_g, folder / "generator_optimizer.safetensors")
        save_optimizer(self.opt_c, folder / "critic_optimizer.safetensors")

    def load(self, folder: Path) -> None:
        for module, root in ((self.student, folder), (self.critic, folder / "critic")):
            cls: Any = type(module)  # a diffusers model class
            saved = cls.from_pretrained(root / "transformer", use_safetensors=True)
            module.load_state_dict(saved.state_dict())
        load_optimizer(self.opt_g, folder / "generator_optimizer.safetensors")
        load_optimizer(self.opt_c, folder / "critic_optimizer.safetensors")

    def recipe(self) -> dict[str, Any]:
        steps = len(self.opts.timesteps)
        t = self.teacher_defaults
        return {
            "method": "dmd2",
            "parents": [self.opts.teacher],
            "teacher": {
                "card": self.opts.teacher,
                "weights": str(self.opts.teacher_weights) if self.opts.teacher_weights else None,
                "steps": t.num_inference_steps,
                "guidance": t.guidance_scale,
                "sampler": getattr(t, "sampler", None),
            },
            "steps": steps,
            "timesteps": list(self.opts.timesteps),
            "sampler": "dmd",
            "guidance": 1.0,
            "real_guidance": self.opts.real_guidance,
            "critic_steps_per_generator": self.opts.critic_steps_per_generator,
            "train_steps": self.cfg.steps,
            "batch_size": self.cfg.batch_size,
            "gan_loss": False,
        }

    def export(self, folder: Path) -> None:
        """The teacher's checkpoint with the student's transformer, and the recipe."""
        self.adapter.export(folder, {"transformer": self.student}, self.recipe())
