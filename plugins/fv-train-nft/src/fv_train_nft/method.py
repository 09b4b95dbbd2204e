"""The ``nft`` method: DiffusionNFT (Zheng et al. 2025, "DiffusionNFT: Online Diffusion Reinforcement
with Forward Process") on a card's serve loop, written only against ``fv_core``'s public API.

One optimisation step (``step``), as published:

1. Rollout. The OLD policy samples ``group_size`` videos for each of ``prompts_per_step`` prompts
   with the card's own ODE sampler and no CFG (guidance 1, as published; ``rollout_guidance`` cycles
   CFG scales over the groups): real requests through the core's ``rollout`` (the serve engine under
   the rollout profile, one ``BehaviorRecord`` per video: content hashes of every step, its seed and
   weights versions; kept under ``output_dir/rollouts/`` with ``save_records``), on a loaded model whose
   live transformer *is* the old role. Seeds
   are a function of (config seed, step, sample), so a resumed run rolls out the same videos. With
   ``group_variation`` a group's videos are variations (variation seeds) of one seed.
2. Reward. The reward plugin (``fv_core.training.load_reward``, e.g. ``shapes-detector``) scores
   the decoded frames against their prompts.
3. Advantages. Per prompt ``A = (reward - group mean) / (std + 1e-4)`` (std over the whole batch
   by default, as published), then the optimality probability ``r = 1/2 + clip(A / 5, -1, 1) / 2``.
   With ``train_groups`` only the groups whose rewards differ most (per CFG scale) go on to the loss.
4. Loss on the forward process. For every clean rollout latent ``x0`` and each of
   ``train_timesteps`` noise levels ``t`` of the rollout schedule (fresh noise each), with
   ``x_t = (1 - t) x0 + t eps``: the student's velocity ``v`` (train profile), the old policy's and the
   frozen reference's (serve profile, no grad); implicit policies ``v+ = (1-beta) v_old + beta v``
   and ``v- = (1+beta) v_old - beta v``; loss ``5 * mean(r L+ / beta + (1-r) L- / beta) +
   kl_weight * ||v - v_ref||^2`` where ``L+/-`` is the x0 error of ``v+/-`` over its own stop-grad
   mean absolute error (``fv_train_nft.loss``). A group rolled out at CFG scale g > 1 trains each
   role's guided velocity ``v_u + g (v_c - v_u)`` instead (``v_u``: the card's negative prompt), the
   velocity that sampled it. Gradients of every minibatch and level accumulate into one AdamW step
   (grad clipping).
5. Old policy. ``old <- eta old + (1 - eta) student`` with ``eta = min(0.001 * steps done, 0.5)``;
   the model's transformer weights version is bumped so no cached text K/V of the previous old
   weights is reused.

Roles: student (trains the transformer, or LoRA adapters on it with ``lora_rank``), old (samples),
reference (frozen copy of the start, the KL anchor). The text encoder, VAE and tokenizer are the
card's, frozen and shared. ``export`` writes the student's transformer (adapters folded in) over the
starting checkpoint with ``fv_recipe.json``; a LoRA student's adapters also go, alone, to
``lora/pytorch_lora_weights.safetensors`` (diffusers' format), served per request over that checkpoint.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

import fv_core
from fv_core import ConfigError
from fv_core.adapters import save_lora
from fv_core.training import (
    Consistency,
    MethodSpec,
    Role,
    RoleSpec,
    TrainConfig,
    check_train_device,
    load_optimizer,
    load_reward,
    make_optimizer,
    rollout,
    save_optimizer,
    save_records,
    set_lr,
    train_adapter,
    validate_options,
)
from fv_train_nft.config import NftOptions, read_prompts
from fv_train_nft.lora import add_lora, load_lora_state, lora_state, lora_weights, merged_weights
from fv_train_nft.loss import advantages, blend_old, nft_loss, old_decay, optimality

TRAINED = ("transformer",)  # what the student trains; every other component is the card's, shared
SEED_STRIDE = 1_000_003  # rollout seed = base + step * SEED_STRIDE + sample (never the eval seeds 0..)
EVAL_SEED_BASE = 0  # eval prompt i, seed s: seed s (as fv eval seeds its prompt set)
LORA_FILE = "student_lora.safetensors"  # a LoRA student's adapters in a checkpoint folder (to resume)
LORA_EXPORT = "lora"  # the export's subfolder holding them in diffusers' format (to serve)


class NftMethod:
    """DiffusionNFT; see the module docstring."""

    spec = MethodSpec(
        roles=(
            RoleSpec(Role.STUDENT, trains=TRAINED, holds=TRAINED),
            RoleSpec(Role.OLD, holds=TRAINED),
            RoleSpec(Role.REFERENCE, holds=TRAINED),
        ),
        consistency=Consistency.C2_FREE,
        # per rollout: its seed (chosen by the method) and the transformer weights version it ran on
        # (checked to be the old policy's); the samples are the rollouts' clean latents - no per-step
        # predictions or log-probabilities
        record_fields=("seed", "weights_versions"),
        devices=("cpu", "cuda"),
    )

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg, self.opts = cfg, validate_options(NftOptions, cfg.options, "nft")
        self.prompts = read_prompts(self.opts.prompts, self.opts.prompts_file, "options.prompts_file")
        if not self.prompts:
            raise ConfigError(
                f"options.prompts_file={str(self.opts.prompts_file)!r} holds no prompts. Fix: one per line"
            )
        if self.opts.distinct_prompts and self.opts.prompts_per_step > len(self.prompts):
            raise ConfigError(
                f"options.prompts_per_step={self.opts.prompts_per_step} distinct prompts a step, but there "
                f"are {len(self.prompts)} prompts. Fix: at most {len(self.prompts)} groups a step, or "
                "distinct_prompts: false"
            )
        eval_prompts = read_prompts(
            self.opts.eval_prompts, self.opts.eval_prompts_file, "options.eval_prompts_file"
        )
        self.eval_prompts = eval_prompts or self.prompts
        torch.manual_seed(cfg.seed)
        self.reward = load_reward(self.opts.reward.name, **self.opts.reward.options)
        self.eval_rewards = {k: load_reward(s.name, **s.options) for k, s in self.opts.eval_rewards.items()}
        # the rollout model: its live transformer is the OLD role
        self.device = check_train_device(cfg, self.spec)
        self.model = fv_core.load(self.opts.card, self.opts.init_weights, device=cfg.device)
        extra = (
            {"max_sequence_length": self.opts.max_sequence_length} if self.opts.max_sequence_length else {}
        )
        self.adapter = train_adapter(self.model, **extra)
        old = self.adapter.module("transformer").requires_grad_(False)
        self.roles: dict[Role, dict[str, torch.nn.Module]] = {
            Role.OLD: {"transformer": old},
            Role.STUDENT: {"transformer": copy.deepcopy(old).requires_grad_(True)},
            Role.REFERENCE: {"transformer": copy.deepcopy(old).requires_grad_(False)},
        }
        for module in self.roles[Role.STUDENT].values():
            module.train()
            if self.opts.lora_rank:  # only the adapters train
                alpha = self.opts.lora_alpha or self.opts.lora_rank
                add_lora(module, self.opts.lora_rank, alpha, self.opts.lora_targets)
        self.opt = make_optimizer(self.trainable(), cfg.optim)
        self.negative: torch.Tensor | None = None  # the negative prompt's embeddings (guided groups)
        self.old_version: str | None = None  # the rollout model's transformer version (None: as loaded)
        self.versions: list[str | None] = []  # the transformer version each of the last videos ran on
        self.sigmas = schedule(self.opts.rollout_steps, self.opts.flow_shift, self.opts.max_level)
        self.levels = self.opts.train_timesteps or max(1, math.floor(0.99 * self.opts.rollout_steps))
        if self.levels > len(self.sigmas):
            raise ConfigError(
                f"options.train_timesteps={self.levels} exceeds the {len(self.sigmas)} levels of the "
                f"rollout schedule (rollout_steps={self.opts.rollout_steps}). Fix: at most {len(self.sigmas)}"
            )

    def trainable(self) -> list[torch.nn.Parameter]:
        return [p for m in self.roles[Role.STUDENT].values() for p in m.parameters() if p.requires_grad]

    def student_weights(self) -> dict[str, torch.nn.Module]:
        """The student's transformer with plain weights (a LoRA student's adapters folded in)."""
        student = self.roles[Role.STUDENT]["transformer"]
        if not self.opts.lora_rank:
            return {"transformer": student}
        plain = copy.deepcopy(self.roles[Role.REFERENCE]["transformer"])
        plain.load_state_dict(merged_weights(student))
        return {"transformer": plain}

    # ---- rollout ----

    def request_params(self, steps: int, guidance: float) -> dict[str, Any]:
        params: dict[str, Any] = {"num_inference_steps": steps, "guidance_scale": guidance}
        if self.opts.sampler:
            params["sampler"] = self.opts.sampler
        if self.opts.max_sequence_length:
            params["max_sequence_length"] = self.opts.max_sequence_length
        return params

    def generate(
        self,
        model: Any,
        prompts: list[str],
        seeds: list[int],
        steps: int,
        guidance: float | list[float],
        extra: list[dict[str, Any]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(clean latents [N, ...], frames [N, F, H, W, 3]) of ``model`` through the core's rollout (one
        CFG scale, or one per video; ``extra``: more request params per video); ``self.versions`` the
        transformer weights version each ran on, ``self.records`` each video's BehaviorRecord."""
        scales = guidance if isinstance(guidance, list) else [guidance] * len(prompts)
        requests = [
            {**self.request_params(steps, g), "prompt": p, "seed": s, **(e or {})}
            for p, s, g, e in zip(prompts, seeds, scales, extra or [None] * len(prompts), strict=True)
        ]
        rollouts = rollout(model, requests, max_batch_rows=64, refs=True)
        self.records = [r.record for r in rollouts]
        results = [r.result for r in rollouts]
        latents = torch.cat(
            [r.outputs["latents"].reshape(1, *r.outputs["latents"].shape[-4:]) for r in results]
        )
        frames = torch.stack([r.outputs["frames"].cpu() for r in results])  # the rewards read them here
        self.versions = [r.metrics.get("weights_versions", {}).get("transformer") for r in results]
        return latents.clone(), frames.clone()

    def rollout(self, step: int) -> dict[str, Any]:
        """Step ``step``'s groups from the old policy: prompts, latents, rewards, advantages, r."""
        gen = torch.Generator().manual_seed(self.cfg.seed * SEED_STRIDE + step)
        count = self.opts.prompts_per_step
        if self.opts.distinct_prompts:
            picks = torch.randperm(len(self.prompts), generator=gen)[:count].tolist()
        else:
            picks = torch.randint(len(self.prompts), (count,), generator=gen).tolist()
        prompts = [self.prompts[i] for i in picks for _ in range(self.opts.group_size)]
        groups = torch.arange(len(picks)).repeat_interleave(self.opts.group_size)
        scales = self.opts.rollout_guidance
        guidance = [
            float(scales[k % len(scales)]) for k in range(len(picks)) for _ in range(self.opts.group_size)
        ]
        base = 10_000 + (self.cfg.seed * 7919 + step) * SEED_STRIDE
        seeds = [base + i for i in range(len(prompts))]
        extra = None
        if self.opts.group_variation is not None:  # one seed per group, each member a variation of it
            extra = [{"variation_seed": s, "variation_strength": self.opts.group_variation} for s in seeds]
            seeds = [base + len(prompts) + int(g) for g in groups]  # none of the members' seeds
        latents, frames = self.generate(self.model, prompts, seeds, self.opts.rollout_steps, guidance, extra)
        if self.old_version is not None and set(self.versions) != {self.old_version}:
            raise RuntimeError(
                f"rollouts ran on transformer versions {sorted(map(str, set(self.versions)))}, not the old "
                f"policy's {self.old_version!r}"
            )
        if self.opts.save_records:
            save_records(Path(self.cfg.output_dir) / "rollouts" / f"step-{step:06d}", self.records)
        rewards = self.reward(frames, prompts).float()
        adv = advantages(rewards, groups, self.opts.global_std)
        keep = self.trained_samples(rewards, groups)
        return {
            "prompts": [prompts[i] for i in keep.tolist()],
            "groups": groups[keep],
            "latents": latents[keep],
            "rewards": rewards,
            "advantages": adv[keep],
            "r": optimality(adv[keep], self.opts.adv_clip_max),
            "guidance": torch.tensor(guidance)[keep],
            "rollout_guidance": torch.tensor(guidance),
            "generator": gen,
        }

    def trained_samples(self, rewards: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
        """Indices of the samples the loss trains on: every group's, or (``train_groups``) those of
        the groups with the largest within-group reward std (ties: the earlier group), the same share
        of them from each rollout CFG scale (the first scales take the remainder)."""
        count, n = self.opts.train_groups, int(groups.max()) + 1
        if count is None or count >= n:
            return torch.arange(len(rewards))
        stds = torch.stack([rewards[groups == g].std(unbiased=False) for g in range(n)])
        scales = self.opts.rollout_guidance
        by_scale = [[g for g in range(n) if g % len(scales) == k] for k in range(len(scales))]
        chosen: list[int] = []
        for k, members in enumerate(by_scale):
            take = count // len(scales) + (1 if k < count % len(scales) else 0)
            order = torch.argsort(-stds[members], stable=True)[:take].tolist()
            chosen += [members[i] for i in order]
        return torch.isin(groups, torch.tensor(chosen)).nonzero().flatten()

    # ---- the step ----

    def step(self, step: int) -> dict[str, float]:
        lr = set_lr(self.opt, self.cfg.optim, step, self.cfg.steps)
        batch = self.rollout(step)
        stats = self.accumulate(batch, batch["generator"])
        grad = torch.nn.utils.clip_grad_norm_(self.trainable(), self.cfg.optim.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        eta = old_decay(step + 1, self.opts.eta_rate, self.opts.eta_max, self.opts.eta_flat)
        self.update_old(eta, step + 1)
        return {
            **stats,
            "reward": batch["rewards"].mean().item(),
            "reward_std": batch["rewards"].std().item(),
            "r_mean_abs_dev": (batch["r"] - 0.5).abs().mean().item(),
            **self.reward_by_guidance(batch),
            "grad_norm": grad.item(),
            "eta": eta,
            "lr": lr,
        }

    def reward_by_guidance(self, batch: dict[str, Any]) -> dict[str, float]:
        """The mean rollout reward per CFG scale, when the step rolled out at more than one."""
        scales, rewards = batch["rollout_guidance"], batch["rewards"]
        if len(scales.unique()) < 2:
            return {}
        return {f"reward@g{g:g}": rewards[scales == g].mean().item() for g in scales.unique().tolist()}

    def accumulate(self, batch: dict[str, Any], gen: torch.Generator) -> dict[str, float]:
        """Backward of the NFT loss over every (sample, level) pair: minibatches of ``batch_size``
        pairs, each sample on ``levels`` distinct levels of the rollout schedule. With
        ``shared_noise`` a group's members are noised at the same levels with the same eps."""
        x0_all, prompts = batch["latents"], batch["prompts"]
        r_all = batch["r"].to(self.device)
        g_all = batch.get("guidance", torch.ones(len(prompts))).to(self.device)
        n = len(prompts)
        with torch.no_grad():
            embeds_all = self.adapter.conditioning(prompts)  # frozen text encoder, as served
            if bool((g_all > 1).any()):  # the unconditional branch's text: the card's negative prompt
                self.negative = self.adapter.conditioning([self.negative_prompt()])
        # the noise draws: one per sample, or (shared_noise) one per group, which all its members share
        draws = batch["groups"] if self.opts.shared_noise else torch.arange(n)
        draw_of = {int(d): k for k, d in enumerate(draws.unique())}
        levels = torch.stack(
            [torch.randperm(len(self.sigmas), generator=gen)[: self.levels] for _ in range(len(draw_of))]
        )[[draw_of[int(d)] for d in draws]]
        shared = (
            torch.randn(len(draw_of), self.levels, *x0_all.shape[1:], generator=gen).to(self.device)
            if self.opts.shared_noise
            else None
        )
        pairs = [(i, j) for j in range(self.levels) for i in range(n)]
        order = torch.randperm(len(pairs), generator=gen).tolist()
        pairs = [pairs[k] for k in order]
        size = self.cfg.batch_size
        chunks = [pairs[k : k + size] for k in range(0, len(pairs), size)]
        totals = {"loss": 0.0, "loss_policy": 0.0, "loss_kl": 0.0, "loss_positive": 0.0, "loss_negative": 0.0}
        for chunk in chunks:
            idx = torch.tensor([i for i, _ in chunk], device=self.device)
            t = self.sigmas[torch.stack([levels[i, j] for i, j in chunk])].to(self.device)
            x0 = x0_all[idx]
            if shared is None:
                noise = torch.randn(x0.shape, generator=gen).to(self.device)
            else:
                noise = torch.stack([shared[draw_of[int(draws[i])], j] for i, j in chunk])
            x_t = (1 - t.view(-1, 1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1, 1) * noise
            parts = self.loss(x_t, x0, t, embeds_all[idx], r_all[idx], g_all[idx])
            (parts.loss * len(chunk) / len(pairs)).backward()
            w = len(chunk) / len(pairs)
            totals["loss"] += parts.loss.item() * w
            totals["loss_policy"] += parts.policy.item() * w
            totals["loss_kl"] += parts.kl.item() * w
            totals["loss_positive"] += parts.positive.item() * w
            totals["loss_negative"] += parts.negative.item() * w
        return totals

    def negative_prompt(self) -> str:
        """The prompt of the card's unconditional CFG branch (its default negative prompt)."""
        return str(getattr(self.model.prepare({"prompt": "-"}).params, "negative_prompt", "") or "")

    def loss(
        self,
        x_t: torch.Tensor,
        x0: torch.Tensor,
        t: torch.Tensor,
        embeds: torch.Tensor,
        r: torch.Tensor,
        guidance: torch.Tensor | None = None,
    ):
        """The NFT loss of one minibatch: old and reference velocities under the serve profile, the
        student's under the train profile (the same denoise body the server runs). Samples rolled out
        at a CFG scale g > 1 are trained on each role's guided velocity ``v_u + g (v_c - v_u)``."""
        v_old = self.guided(Role.OLD, x_t, t, embeds, guidance, False)
        v_ref = self.guided(Role.REFERENCE, x_t, t, embeds, guidance, False)
        v = self.guided(Role.STUDENT, x_t, t, embeds, guidance, True)
        o = self.opts
        weight = None if guidance is None else guidance.double().pow(-o.guided_loss_power)
        return nft_loss(
            v, v_old, v_ref, x_t, x0, t, r, o.beta, o.kl_weight, o.adv_clip_max, o.adaptive_weight, weight
        )

    def guided(
        self,
        role: Role,
        x_t: torch.Tensor,
        t: torch.Tensor,
        embeds: torch.Tensor,
        guidance: torch.Tensor | None,
        train: bool,
    ) -> torch.Tensor:
        """``role``'s velocity per sample: conditional where its guidance is 1, else the CFG combine of
        its conditional and unconditional forwards (one batched forward over both)."""
        transformer = self.roles[role]["transformer"]
        guided = [] if guidance is None else (guidance > 1).nonzero().flatten().tolist()
        if not guided:
            return self.adapter.velocity(transformer, x_t, t, embeds, train)
        rows = torch.tensor(guided, device=x_t.device)
        assert self.negative is not None, "accumulate encodes the negative prompt first"
        negative = self.negative.to(embeds.dtype).expand(len(guided), *embeds.shape[1:])
        v_all = self.adapter.velocity(
            transformer,
            torch.cat([x_t, x_t[rows]]),
            torch.cat([t, t[rows]]),
            torch.cat([embeds, negative]),
            train,
        )
        v_c, v_u = v_all[: len(x_t)], v_all[len(x_t) :]
        cond = v_c[rows].detach() if train and self.opts.guided_grad == "uncond" else v_c[rows]
        assert guidance is not None
        g = guidance[rows].to(v_c.dtype).view(-1, *([1] * (v_c.ndim - 1)))
        return v_c.index_copy(0, rows, v_u + g * (cond - v_u))

    def update_old(self, eta: float, done: int) -> None:
        """The decayed old-policy update, then a new weights version for the rollout model's
        transformer (cached text K/V of the previous old weights must not be reused)."""
        student = merged_weights(self.roles[Role.STUDENT]["transformer"])
        blend_old(self.roles[Role.OLD]["transformer"], student, eta)
        bump = getattr(self.model.instance, "set_weights_version", None)
        if bump is None:
            raise ConfigError(
                f"{self.model.card.model_id!r}'s instance has no set_weights_version: its caches cannot "
                "follow the old policy's updates. Fix: train a card whose family supports weight versions"
            )
        self.old_version = f"nft-old-{done}"
        bump("transformer", self.old_version)

    # ---- evaluation ----

    @torch.no_grad()
    def evaluate(self, step: int) -> dict[str, float]:
        """Mean training reward and each ``eval_rewards`` metric of the student's videos on the eval
        prompts (fixed seeds), per guidance scale in ``eval_guidance``, through the serve engine."""
        if not self.opts.eval_seeds:
            return {}
        prompts = [p for s in range(self.opts.eval_seeds) for p in self.eval_prompts]
        seeds = [EVAL_SEED_BASE + s for s in range(self.opts.eval_seeds) for _ in self.eval_prompts]
        metrics: dict[str, float] = {}
        with tempfile.TemporaryDirectory() as tmp:
            self.export(Path(tmp))
            model = fv_core.load(self.opts.card, tmp, device=self.cfg.device)
            try:
                for g in self.opts.eval_guidance:
                    _, frames = self.generate(model, prompts, seeds, self.opts.eval_steps, g)
                    metrics[f"reward@g{g:g}"] = round(self.reward(frames, prompts).float().mean().item(), 4)
                    for name, reward in self.eval_rewards.items():
                        metrics[f"{name}@g{g:g}"] = round(reward(frames, prompts).float().mean().item(), 4)
            finally:
                model.close()
        return metrics

    # ---- checkpoints ----

    def save(self, folder: Path) -> None:
        """``folder`` is a loadable model with the student's weights; ``folder/old`` holds the old
        policy's transformer; plus the optimiser state and a LoRA student's adapters. (The reference
        is the starting checkpoint, which is also a LoRA student's base.)"""
        self.export(folder)
        if self.opts.lora_rank:
            save_file(lora_state(self.roles[Role.STUDENT]["transformer"]), folder / LORA_FILE)
        self.roles[Role.OLD]["transformer"].save_pretrained(
            folder / "old" / "transformer", safe_serialization=True
        )
        save_optimizer(self.opt, folder / "optimizer.safetensors")

    def load(self, folder: Path) -> None:
        plain = [(Role.OLD, folder / "old")]  # roles saved as plain weights
        if self.opts.lora_rank:
            load_lora_state(self.roles[Role.STUDENT]["transformer"], load_file(folder / LORA_FILE))
        else:
            plain.append((Role.STUDENT, folder))
        for role, root in plain:
            for name, module in self.roles[role].items():
                saved = type(module).from_pretrained(root / name, use_safetensors=True)
                module.load_state_dict(saved.state_dict())
        load_optimizer(self.opt, folder / "optimizer.safetensors")
        state = (
            json.loads((folder / "trainer_state.json").read_text())
            if (folder / "trainer_state.json").is_file()
            else {}
        )
        self.model_version(state.get("step"))

    def model_version(self, step: int | None) -> None:
        bump = getattr(self.model.instance, "set_weights_version", None)
        if bump is not None:
            self.old_version = f"nft-old-{step if step is not None else 'resumed'}"
            bump("transformer", self.old_version)

    def export(self, folder: Path) -> None:
        """The student's transformer over the starting checkpoint, with the recipe."""
        o = self.opts
        recipe = {
            "method": "nft",
            "parents": [o.card if o.init_weights is None else str(o.init_weights)],
            "reward": o.reward.model_dump(),
            "rollout": {"steps": o.rollout_steps, "sampler": o.sampler or "card default",
                        "guidance": o.rollout_guidance, "guided_grad": o.guided_grad,
                        "guided_loss_power": o.guided_loss_power,
                        "prompts_per_step": o.prompts_per_step, "distinct_prompts": o.distinct_prompts,
                        "group_size": o.group_size,
                        "train_groups": o.train_groups, "group_variation": o.group_variation,
                        "lora": {"rank": o.lora_rank, "alpha": o.lora_alpha or o.lora_rank, "targets": o.lora_targets}
                        if o.lora_rank else None,
                        "shared_noise": o.shared_noise},
            "beta": o.beta, "kl_weight": o.kl_weight, "adv_clip_max": o.adv_clip_max,
            "old_decay": {"rate": o.eta_rate, "max": o.eta_max, "flat": o.eta_flat},
            "train_timesteps": self.levels, "flow_shift": o.flow_shift, "max_level": o.max_level, "steps": self.cfg.steps, "seed": self.cfg.seed,
        }  # fmt: skip
        self.adapter.export(folder, self.student_weights(), recipe)
        shutil.rmtree(folder / LORA_EXPORT, ignore_errors=True)  # a parent export's adapters are not ours
        if o.lora_rank:
            pairs = lora_weights(self.roles[Role.STUDENT]["transformer"])
            save_lora(folder / LORA_EXPORT, self.model.card.adapters.loader, {"transformer": pairs})


def schedule(steps: int, shift: float, top: float = 1.0) -> torch.Tensor:
    """The noise levels the loss trains on: ``steps`` uniform levels from ``top`` down (1: the rollout
    schedule's), shifted as the flow sampler shifts them (``s * u / (1 + (s - 1) * u)``)."""
    u = torch.linspace(top, 0.0, steps + 1)[:-1]
    return shift * u / (1 + (shift - 1) * u)
