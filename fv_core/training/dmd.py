"""Distribution matching (DMD, Yin et al. 2024): what DMD-style distillation methods share.

A frozen **teacher** (the real score), a **critic** (the fake score: a copy of the teacher trained
with the flow loss on the student's detached samples, so it tracks the student's distribution) and
a **student** trained on its own samples with the distribution-matching loss. A method subclasses
:class:`DistributionMatching` and says how the student samples (``sample``) and what it exports;
the scores, both losses, the two-timescale update step, the evaluation gap and the checkpoints are here.

``dm_loss``: the KL gradient between the student's output distribution and the teacher's, estimated
at a noisy copy of the sample by the difference of the fake and real x0 predictions, normalised per
sample by ``mean|x0 - real|`` (DMD's weighting), applied as ``0.5 * ||x0 - sg(x0 - grad)||^2``.
``flow_loss``: flow matching (velocity target ``noise - x0``), the critic's.

DMD2's GAN term (Yin et al. 2024, "Improved Distribution Matching Distillation"), on when its weights
are: a head (:class:`GANHead`) on the critic's last hidden states of noised samples learns, with the
critic, to tell real clips (a registered dataset) from the student's samples (non-saturating logistic
loss); the student learns to fool it. Real data reaches only this term; the rest stays data-free.
DMD's regression (on with ``regression_weight``): the student against the teacher's own ODE sample of
the same noise (:meth:`DistributionMatching.teacher_sample`), as each method samples.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import fv_core
from fv_core import ConfigError
from fv_core.training.config import TrainConfig, read_prompts, validate_options
from fv_core.training.datasets import load_dataset
from fv_core.training.dmd_options import DMDOptions
from fv_core.training.method import Role
from fv_core.training.trainer import load_optimizer, make_optimizer, save_optimizer, set_lr

GAN_HEAD_FILE = "critic_gan_head.safetensors"


def draw_sigmas(n: int, lo: float, hi: float, shift: float, gen: torch.Generator) -> torch.Tensor:
    """``n`` noise levels: uniform in ``[lo, hi]`` under the flow shift ``s*u / (1 + (s-1)*u)``."""
    u = lo + (hi - lo) * torch.rand(n, generator=gen)
    return shift * u / (1 + (shift - 1) * u)


def noised(x0: torch.Tensor, sigma: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """``x0`` [B, ...] at flow level ``sigma`` [B]."""
    s = sigma.view(-1, *([1] * (x0.dim() - 1)))
    return (1 - s) * x0 + s * noise


def dm_loss(x0: torch.Tensor, real: torch.Tensor, fake: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The distribution-matching loss on the sample ``x0`` (with grad) given the teacher's (``real``) and
    the critic's (``fake``) x0 predictions at its noisy copy; and the mean magnitude of its gradient."""
    with torch.no_grad():
        dims = tuple(range(1, x0.dim()))
        weight = (x0.detach() - real).abs().mean(dim=dims, keepdim=True)
        grad = torch.nan_to_num((fake - real) / weight)
    return 0.5 * F.mse_loss(x0, (x0 - grad).detach()), grad.abs().mean()


def flow_loss(velocity: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Flow matching: the predicted velocity against ``noise - x0``."""
    return F.mse_loss(velocity, noise - x0)


class GANHead(torch.nn.Module):
    """A discriminator on a critic's per-token hidden states [B, tokens, dim]: a logit per token,
    averaged per sample [B] (each patch is judged, as in a patch GAN)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.LayerNorm(dim), torch.nn.Linear(dim, dim), torch.nn.SiLU(), torch.nn.Linear(dim, 1)
        )

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.net(features.float()).mean((1, 2))


class DistributionMatching:
    """The DMD machinery of a method; a subclass sets ``adapter`` and calls :meth:`setup_roles`, and
    implements ``sample(embeds, gen, grad)`` (the student's samples, x0 [B, ...]) and
    ``regression_loss(embeds, gen)`` (its error against :meth:`teacher_sample`, for ``regression_weight``)."""

    cfg: TrainConfig
    opts: Any  # a DMDOptions subclass
    adapter: Any  # the teacher family's TrainAdapter

    def load_teacher(self, cfg: TrainConfig, options: type[DMDOptions], method: str) -> Any:
        """Validate the options, seed, read the prompts; the loaded teacher model."""
        self.cfg, self.opts = cfg, validate_options(options, cfg.options, method)
        torch.manual_seed(cfg.seed)
        self.prompts = read_prompts(self.opts.prompts)
        model = fv_core.load(self.opts.teacher, self.opts.teacher_weights)
        self.teacher_defaults = model.prepare({"prompt": "-"}).params
        return model

    def setup_roles(self) -> None:
        """Teacher (frozen), student (the teacher's copy, with ``student_weights``' transformer when
        given), an EMA of it when ``ema_decay`` is set, critic (the teacher's copy) and its GAN head when
        the GAN term is on; both optimisers; every prompt's embeddings once."""
        teacher = self.adapter.module("transformer").requires_grad_(False).eval()
        self.adapter.module("text_encoder").requires_grad_(False).eval()
        start = copy.deepcopy(teacher)
        if self.opts.student_weights is not None:
            weights = fv_core.load(self.opts.teacher, self.opts.student_weights).instance
            start.load_state_dict(weights.component("transformer").state_dict())
        self.roles: dict[Role, dict[str, torch.nn.Module]] = {
            Role.TEACHER: {"transformer": teacher},
            Role.STUDENT: {"transformer": start.requires_grad_(True)},
        }
        if self.opts.ema_decay is not None:
            self.roles[Role.EMA] = {"transformer": copy.deepcopy(start).requires_grad_(False).eval()}
        self.roles[Role.CRITIC] = {"transformer": copy.deepcopy(teacher).requires_grad_(True)}
        with torch.no_grad():  # the frozen text encoder
            self.embeds = self.adapter.conditioning(self.prompts)
            self.uncond = self.adapter.conditioning([""]) if self.opts.real_guidance > 1 else None
        self.gan_head = self._gan_head() if self.opts.gan else None
        self.opt_g = make_optimizer(list(self.student.parameters()), self.cfg.optim)
        self.critic_optim = self.cfg.optim.model_copy(update={"lr": self.opts.critic_lr or self.cfg.optim.lr})
        self.opt_c = make_optimizer(self.critic_groups(), self.critic_optim)
        self._last_g: dict[str, float] = {}
        self.steps_done = 0

    def _gan_head(self) -> GANHead:
        """The GAN head, sized by the critic's features; the real clips' dataset."""
        if not hasattr(self.adapter, "features"):
            raise ConfigError(
                f"options.gan_data={self.opts.gan_data!r}: the training adapter of {self.opts.teacher!r} "
                "offers no features(transformer, latents, sigma, embeds) for the GAN head to read. Fix: "
                "drop the GAN options, or train a family whose adapter has it (fv-wan's does)"
            )
        self.dataset = load_dataset(self.opts.gan_data)
        with torch.no_grad():
            real = self.adapter.encode_video(self.dataset.batch(self.cfg.data.seed, 0, 1)[0])
            sample = self.adapter.noise(1, torch.Generator().manual_seed(0))
            if real.shape != sample.shape:
                raise ConfigError(
                    f"options.gan_data={self.opts.gan_data!r} gives clips of latent shape {list(real.shape)}, "
                    f"the student samples {list(sample.shape)}. Fix: a dataset at the teacher's size"
                )
            dim = self.adapter.features(self.critic, real, torch.ones(1), self.embeds[:1]).shape[-1]
        return GANHead(dim)

    def critic_groups(self) -> list[dict[str, Any]]:
        """The critic optimiser's parameter groups: the fake score, and the GAN head at its own scale."""
        groups: list[dict[str, Any]] = [{"params": list(self.critic.parameters())}]
        if self.gan_head is not None:
            groups.append(
                {"params": list(self.gan_head.parameters()), "lr_scale": self.opts.gan_head_lr_scale}
            )
        return groups

    @property
    def student(self) -> torch.nn.Module:
        return self.roles[Role.STUDENT]["transformer"]

    @property
    def critic(self) -> torch.nn.Module:
        return self.roles[Role.CRITIC]["transformer"]

    @property
    def teacher(self) -> torch.nn.Module:
        return self.roles[Role.TEACHER]["transformer"]

    @property
    def ema(self) -> torch.nn.Module:
        return self.roles[Role.EMA]["transformer"]

    @property
    def exported(self) -> torch.nn.Module:
        """What the method exports and evaluates: the EMA when it keeps one, else the student."""
        return self.ema if Role.EMA in self.roles else self.student

    def sample(self, embeds: torch.Tensor, gen: torch.Generator, grad: bool) -> torch.Tensor:
        raise NotImplementedError

    # ---- scores and losses ----

    def real_x0(self, x: torch.Tensor, sigma: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        v = self.adapter.velocity(self.teacher, x, sigma, embeds)
        if self.uncond is not None:
            v_u = self.adapter.velocity(self.teacher, x, sigma, self.uncond.expand_as(embeds))
            v = v_u + self.opts.real_guidance * (v - v_u)
        return x - sigma.view(-1, 1, 1, 1, 1) * v

    def fake_x0(self, x: torch.Tensor, sigma: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        return x - sigma.view(-1, 1, 1, 1, 1) * self.adapter.velocity(self.critic, x, sigma, embeds)

    def draw_sigmas(self, n: int, gen: torch.Generator) -> torch.Tensor:
        o = self.opts
        sigma = draw_sigmas(n, o.min_sigma, o.max_sigma, o.shift, gen)
        if o.detail_fraction:
            detail = torch.rand(n, generator=gen) < o.detail_fraction
            sigma = torch.where(detail, draw_sigmas(n, o.min_sigma, o.detail_max_sigma, 1.0, gen), sigma)
        return sigma

    def generator_loss(
        self, x0: torch.Tensor, embeds: torch.Tensor, gen: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The distribution-matching loss on the student's sample ``x0`` at a random noise level."""
        sigma = self.draw_sigmas(x0.shape[0], gen)
        with torch.no_grad():
            noisy = noised(x0.detach(), sigma, torch.randn(x0.shape, generator=gen))
            real, fake = self.real_x0(noisy, sigma, embeds), self.fake_x0(noisy, sigma, embeds)
        return dm_loss(x0, real, fake)

    def critic_loss(
        self, x0: torch.Tensor, embeds: torch.Tensor, gen: torch.Generator, sigma: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Flow matching of the fake score on the student's (detached) samples."""
        sigma = self.draw_sigmas(x0.shape[0], gen) if sigma is None else sigma
        noise = torch.randn(x0.shape, generator=gen)
        velocity = self.adapter.velocity(
            self.critic, noised(x0.detach(), sigma, noise), sigma, embeds, train=True
        )
        return flow_loss(velocity, x0.detach(), noise)

    # ---- the GAN term ----

    def discriminate(self, x0: torch.Tensor, embeds: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """The GAN head's logits [B] of ``x0`` noised to a random level up to ``gan_max_sigma`` (real:
        positive)."""
        top = self.opts.gan_max_sigma or self.opts.max_sigma
        sigma = draw_sigmas(x0.shape[0], self.opts.min_sigma, top, self.opts.shift, gen)
        noisy = noised(x0, sigma, torch.randn(x0.shape, generator=gen))
        assert self.gan_head is not None
        return self.gan_head(self.adapter.features(self.critic, noisy, sigma, embeds, train=True))

    def critic_gan_loss(
        self, x0: torch.Tensor, embeds: torch.Tensor, step: int, gen: torch.Generator
    ) -> dict[str, torch.Tensor]:
        """The critic's side: real clips (the dataset's ``step``-th batch) up, the student's ``x0`` down."""
        video, captions = self.dataset.batch(self.cfg.data.seed, step * x0.shape[0], x0.shape[0])
        with torch.no_grad():
            real, real_embeds = self.adapter.encode_video(video), self.adapter.conditioning(captions)
        logit_real = self.discriminate(real, real_embeds, gen)
        logit_fake = self.discriminate(x0.detach(), embeds, gen)
        loss = F.softplus(-logit_real).mean() + F.softplus(logit_fake).mean()
        return {
            "loss_gan_critic": loss,
            "gan_real_logit": logit_real.mean().detach(),
            "gan_fake_logit": logit_fake.mean().detach(),
        }

    # ---- the step: a critic update, and first a generator update every few steps (TTUR) ----

    def step(self, step: int) -> dict[str, float]:
        self.steps_done = step + 1  # what an export (a checkpoint's recipe) says it was trained for
        gen = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + step)  # per step: resume is exact
        embeds = self.embeds[torch.randint(len(self.prompts), (self.cfg.batch_size,), generator=gen)]
        self.student.train()
        self.critic.train()
        ratio = self.opts.critic_steps_per_generator
        if step % ratio == 0:
            x0 = self.generator_step(step // ratio, embeds, gen)
        else:
            with torch.no_grad():
                x0 = self.sample(embeds, gen, False)
        lr_c = set_lr(self.opt_c, self.critic_optim, step, self.cfg.steps)
        loss_c = self.critic_loss(x0, embeds, gen)
        gan: dict[str, float] = {}
        total = loss_c
        if self.gan_head is not None:
            terms = self.critic_gan_loss(x0, embeds, step, gen)
            total = loss_c + self.opts.gan_critic_weight * terms["loss_gan_critic"]
            gan = {name: value.item() for name, value in terms.items()}
        self.opt_c.zero_grad(set_to_none=True)
        total.backward()
        trained = [p for group in self.opt_c.param_groups for p in group["params"]]
        norm_c = torch.nn.utils.clip_grad_norm_(trained, self.cfg.optim.grad_clip)
        self.opt_c.step()
        return {
            "loss": loss_c.item(),
            "loss_critic": loss_c.item(),
            "grad_norm_c": norm_c.item(),
            "lr_c": lr_c,
            **gan,
            **self._last_g,
        }

    def generator_step(self, update: int, embeds: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """One student update on its own sample (then ``after_generator_step``); the detached sample."""
        total = -(-self.cfg.steps // self.opts.critic_steps_per_generator)
        lr_g = set_lr(self.opt_g, self.cfg.optim, update, total)
        x0 = self.sample(embeds, gen, True)
        frozen = [self.critic, *([self.gan_head] if self.gan_head is not None else [])]
        for module in frozen:
            module.requires_grad_(False)
        try:
            loss_g, grad_mag = self.generator_loss(x0, embeds, gen)
            extra = self.extra_generator_losses(x0, embeds, gen)
            if self.gan_head is not None:  # the student's side: its samples judged real
                extra["gan"] = (
                    self.opts.gan_generator_weight * F.softplus(-self.discriminate(x0, embeds, gen)).mean()
                )
        finally:  # the critic trains again even when a loss failed
            for module in frozen:
                module.requires_grad_(True)
        self.opt_g.zero_grad(set_to_none=True)
        (loss_g + sum(extra.values())).backward()
        norm_g = torch.nn.utils.clip_grad_norm_(self.student.parameters(), self.cfg.optim.grad_clip)
        self.opt_g.step()
        self.after_generator_step(update)
        self._last_g = {
            "loss_dm": loss_g.item(),
            "dm_grad": grad_mag.item(),
            "grad_norm_g": norm_g.item(),
            "lr_g": lr_g,
            **{f"loss_{name}": loss.item() for name, loss in extra.items()},
        }
        return x0.detach()

    def extra_generator_losses(
        self, x0: torch.Tensor, embeds: torch.Tensor, gen: torch.Generator
    ) -> dict[str, torch.Tensor]:
        """Weighted losses added to the student's distribution-matching loss (logged as ``loss_<name>``):
        the regression onto the teacher's ODE when ``regression_weight`` is set."""
        if not self.opts.regression_weight:
            return {}
        return {"regression": self.opts.regression_weight * self.regression_loss(embeds, gen)}

    def regression_loss(self, embeds: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """The student's error against :meth:`teacher_sample` of fresh noise, as the method samples."""
        raise NotImplementedError

    @torch.no_grad()
    def teacher_sample(self, noise: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """The teacher's sample from ``noise``: its flow ODE by Euler in ``regression_steps`` at its own
        flow shift, guidance 1."""
        s = float(self.teacher_defaults.flow_shift)
        u = torch.linspace(1, 0, self.opts.regression_steps + 1)
        sigmas = (s * u / (1 + (s - 1) * u)).tolist()
        x = noise
        for a, b in zip(sigmas[:-1], sigmas[1:], strict=False):
            v = self.adapter.velocity(self.teacher, x, torch.full((x.shape[0],), a), embeds)
            x = x + (b - a) * v.float()
        return x

    def after_generator_step(self, update: int) -> None:
        """After each student update: the EMA's (a copy before ``ema_start``)."""
        if self.opts.ema_decay is not None:
            self.update_ema(0.0 if update < self.opts.ema_start else self.opts.ema_decay)

    @torch.no_grad()
    def update_ema(self, decay: float) -> None:
        """``ema = decay * ema + (1 - decay) * student`` (a copy at decay 0)."""
        for e, s in zip(self.ema.parameters(), self.student.parameters(), strict=True):
            e.lerp_(s.detach(), 1 - decay)

    # ---- evaluation ----

    @torch.no_grad()
    def dm_gap(self, x0: torch.Tensor, embeds: torch.Tensor, gen: torch.Generator) -> dict[str, float]:
        """At fixed noise levels of the student's samples ``x0``: the critic's flow loss and the relative
        fake/real gap ``mean|fake - real| / mean|x0 - real|`` (0 when the critic cannot tell them from
        the teacher's)."""
        count = x0.shape[0]
        metrics: dict[str, float] = {"x0_std": x0.std().item()}
        for value in self.opts.eval_sigmas:
            sigma = torch.full((count,), value)
            noisy = noised(x0, sigma, torch.randn(x0.shape, generator=gen))
            real, fake = self.real_x0(noisy, sigma, embeds), self.fake_x0(noisy, sigma, embeds)
            metrics[f"dm_gap@{value}"] = ((fake - real).abs().mean() / (x0 - real).abs().mean()).item()
            metrics[f"critic_loss@{value}"] = self.critic_loss(x0, embeds, gen, sigma).item()
        return metrics

    def eval_embeds(self) -> torch.Tensor:
        """The evaluation's fixed prompts (spread over the prompt file)."""
        count = min(self.opts.eval_prompts, len(self.prompts))
        return self.embeds[torch.linspace(0, len(self.prompts) - 1, count).round().long()]

    # ---- checkpoints ----

    def save_state(self, folder: Path, modules: dict[str, torch.nn.Module]) -> None:
        """``modules`` (role folder -> transformer, beside the exported student) and both optimisers."""
        for role, module in modules.items():
            saved: Any = module  # a diffusers model: save_pretrained / from_pretrained
            saved.save_pretrained(folder / role / "transformer", safe_serialization=True)
        if self.gan_head is not None:
            save_file(self.gan_head.state_dict(), folder / GAN_HEAD_FILE)
        save_optimizer(self.opt_g, folder / "generator_optimizer.safetensors")
        save_optimizer(self.opt_c, folder / "critic_optimizer.safetensors")

    def load_state(self, folder: Path, modules: dict[str, torch.nn.Module]) -> None:
        """What ``save_state`` (and the export, under role folder ``""``) wrote."""
        for role, module in modules.items():
            cls: Any = type(module)  # a diffusers model class
            saved = cls.from_pretrained(folder / role / "transformer", use_safetensors=True)
            module.load_state_dict(saved.state_dict())
        if self.gan_head is not None:
            if not (folder / GAN_HEAD_FILE).is_file():
                raise ConfigError(
                    f"checkpoint {folder} has no GAN head ({GAN_HEAD_FILE}), but options.gan_data="
                    f"{self.opts.gan_data!r} turns the GAN term on. Fix: resume with the GAN options of the "
                    "run that saved it, or start a new output_dir"
                )
            self.gan_head.load_state_dict(load_file(folder / GAN_HEAD_FILE))
        load_optimizer(self.opt_g, folder / "generator_optimizer.safetensors")
        load_optimizer(self.opt_c, folder / "critic_optimizer.safetensors")
        recipe = folder / "fv_recipe.json"  # the export beside the state: what it was trained for
        if recipe.is_file():
            self.steps_done = json.loads(recipe.read_text()).get("steps_done", self.steps_done)

    def teacher_recipe(self) -> dict[str, Any]:
        """The recipe's ``teacher`` entry: its card, weights and how it samples."""
        t = self.teacher_defaults
        return {
            "card": self.opts.teacher,
            "weights": str(self.opts.teacher_weights) if self.opts.teacher_weights else None,
            "steps": t.num_inference_steps,
            "guidance": t.guidance_scale,
            "sampler": getattr(t, "sampler", None),
        }
