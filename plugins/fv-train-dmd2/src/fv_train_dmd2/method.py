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
* critic loss: flow matching (velocity target ``noise - x0``) on the detached sample at a random level;
* regression (when ``regression_weight`` is set, DMD's regression loss): the student's x0 against the
  teacher's own sample of the same noise (its ODE, :meth:`teacher_sample`);
* GAN term (when ``gan_data`` and its weights are set): a head on the critic's last hidden states tells
  real clips of a registered dataset from the student's samples, both noised to a random level; the
  critic and head learn it, the student learns to fool it.
* EMA (when ``ema_decay`` is set): an exponential moving average of the student, updated after each
  generator update, is what evaluation and the export use (a single step's weights wander).

The scores, losses, update step and checkpoints are the core's DMD toolkit
(``fv_core.training.dmd``). Every forward runs the family's serve loop bodies through its training adapter
(``fv_core.training.train_adapter``): the student trains on exactly the forward its card serves
(consistency C2-free, checked by the tests). No family plugin is imported.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from fv_core import ConfigError
from fv_core.training import (
    Consistency,
    DistributionMatching,
    MethodSpec,
    Role,
    RoleSpec,
    TrainConfig,
    train_adapter,
)
from fv_train_dmd2.config import DMD2Options

TRANSFORMER = ("transformer",)


class DMD2Method(DistributionMatching):
    """DMD2 distillation; see the module docstring."""

    spec = MethodSpec(
        roles=(
            RoleSpec(Role.STUDENT, trains=TRANSFORMER, holds=TRANSFORMER),
            RoleSpec(Role.EMA, holds=TRANSFORMER),  # only with options.ema_decay
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
        self.adapter = train_adapter(self.load_teacher(cfg, DMD2Options, "dmd2"))
        n = self.adapter.num_train_timesteps
        if max(self.opts.timesteps) > n:
            raise ConfigError(
                f"options.timesteps={self.opts.timesteps} exceed the teacher's num_train_timesteps={n}. "
                f"Fix: use timesteps in (0, {n}]"
            )
        # sigma_k = t_k / n and a final 0: the serving ``dmd`` sampler's schedule, float32
        self.sigmas = torch.tensor([*self.opts.timesteps, 0], dtype=torch.float32) / n
        self.setup_roles()

    # ---- the student's few-step sampler (the serving ``dmd`` sampler's math) ----

    def student_x0(
        self, x: torch.Tensor, k: int, embeds: torch.Tensor, train: bool, model: torch.nn.Module | None = None
    ) -> torch.Tensor:
        """The student's (or ``model``'s) x0 prediction at its step ``k`` (input ``x`` at sigma_k)."""
        sigma = self.sigmas[k]
        model = self.student if model is None else model  # a module's truth value is its length, if any
        velocity = self.adapter.velocity(model, x, sigma.expand(x.shape[0]), embeds, train)
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

    def regression_loss(self, embeds: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """Mean squared error of the student's x0 against the teacher's sample of the same noise, at a
        random step of its schedule: from that noise at the first step, from the sample re-noised later."""
        noise = self.adapter.noise(embeds.shape[0], gen)
        target = self.teacher_sample(noise, embeds)
        k = int(torch.randint(len(self.opts.timesteps), (1,), generator=gen))
        sigma = self.sigmas[k]
        x = noise if k == 0 else (1 - sigma) * target + sigma * torch.randn(target.shape, generator=gen)
        return torch.nn.functional.mse_loss(self.student_x0(x, k, embeds, train=True), target)

    def sample(self, embeds: torch.Tensor, gen: torch.Generator, grad: bool) -> torch.Tensor:
        """A generated sample: the student's x0 at a random step of a simulated rollout."""
        k = int(torch.randint(len(self.opts.timesteps), (1,), generator=gen))
        x = self.simulate(embeds, k, gen)
        with torch.set_grad_enabled(grad):
            return self.student_x0(x, k, embeds, grad)

    # ---- evaluation ----

    @torch.no_grad()
    def evaluate(self, step: int) -> dict[str, float]:
        """On fixed prompts and noise: the exported weights' full rollout (the EMA's when kept, else the
        student's), then the DMD gap at fixed noise levels."""
        self.student.eval()
        self.critic.eval()
        gen = torch.Generator().manual_seed(12345)
        embeds = self.eval_embeds()
        last = len(self.opts.timesteps) - 1
        x0 = self.student_x0(self.simulate(embeds, last, gen), last, embeds, train=False, model=self.exported)
        return self.dm_gap(x0, embeds, gen)

    # ---- checkpoints ----

    def save(self, folder: Path) -> None:
        """``folder`` is itself the exported student (loadable; the EMA when kept, then the trained student
        is in ``student/transformer``), plus ``critic/transformer`` and both optimisers' state."""
        self.export(folder)
        self.save_state(folder, {**self.trained_student(), "critic": self.critic})

    def load(self, folder: Path) -> None:
        if self.trained_student() and not (folder / "student").is_dir():
            raise ConfigError(
                f"checkpoint {folder} has no student/ folder: it was saved without options.ema_decay, which "
                f"is {self.opts.ema_decay} now. Fix: resume with the options of the run that saved it, or "
                "start a new output_dir"
            )
        self.load_state(folder, {"": self.exported, **self.trained_student(), "critic": self.critic})

    def trained_student(self) -> dict[str, torch.nn.Module]:
        """The student's checkpoint folder beside the export, when the export is its EMA."""
        return {"student": self.student} if self.exported is not self.student else {}

    def recipe(self) -> dict[str, Any]:
        return {
            "method": "dmd2",
            "parents": [self.opts.teacher],
            "teacher": self.teacher_recipe(),
            "steps": len(self.opts.timesteps),
            "timesteps": list(self.opts.timesteps),
            "sampler": "dmd",
            "guidance": 1.0,
            "real_guidance": self.opts.real_guidance,
            "critic_steps_per_generator": self.opts.critic_steps_per_generator,
            "train_steps": self.cfg.steps,
            "steps_done": self.steps_done,
            "batch_size": self.cfg.batch_size,
            "student_init": str(self.opts.student_weights) if self.opts.student_weights else "teacher",
            "shift": self.opts.shift,
            "detail_fraction": self.opts.detail_fraction,
            **({"detail_max_sigma": self.opts.detail_max_sigma} if self.opts.detail_fraction else {}),
            "regression_weight": self.opts.regression_weight,
            "regression_steps": self.opts.regression_steps,
            "exported": "ema" if self.opts.ema_decay is not None else "student",
            **({"ema_decay": self.opts.ema_decay} if self.opts.ema_decay is not None else {}),
            "gan_loss": self.opts.gan,
            **(
                {
                    "gan_data": self.opts.gan_data,
                    "gan_generator_weight": self.opts.gan_generator_weight,
                    "gan_critic_weight": self.opts.gan_critic_weight,
                }
                if self.opts.gan
                else {}
            ),
        }

    def export(self, folder: Path) -> None:
        """The teacher's checkpoint with the student's transformer (its EMA when kept), and the recipe."""
        self.adapter.export(folder, {"transformer": self.exported}, self.recipe())
