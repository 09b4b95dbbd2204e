"""Options of the ``nft`` method (a config's ``options:`` section; the rest is the core's
``fv_core.training.TrainConfig``). Defaults are the published ones (DiffusionNFT's official
configuration) where this setting has one: beta 1, KL weight 1e-4, advantages clipped at 5 with the
batch's global std, the old policy's decay ``min(0.001 * step, 0.5)``."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from fv_core.training import StrictModel
from fv_core.training import read_prompts as read_file_prompts


class RewardSpec(StrictModel):
    """A registered reward (``fv_register_rewards``) and the options it is built with."""

    name: str
    options: dict[str, Any] = {}


class NftOptions(StrictModel):
    """Options of the ``nft`` method; see ``fv_train_nft.method`` for what each drives."""

    card: str = "wan2.1-t2v-shapes"  # the card whose serve loop rolls out (and whose weights start)
    init_weights: Path | None = None  # start from this checkpoint folder instead of the card's weights
    reward: RewardSpec = RewardSpec(name="shapes-detector")
    prompts: list[str] = []  # training prompts (or prompts_file; one of the two)
    prompts_file: Path | None = None  # one prompt per line (blank lines and '#' lines skipped)
    prompts_per_step: int = Field(8, gt=0)  # groups per optimisation step
    # each step's groups are distinct prompts, a fresh random subset (the published sampler); False:
    # each group's prompt drawn independently, with replacement (how the shipped NFT card was trained)
    distinct_prompts: bool = False
    group_size: int = Field(8, ge=2)  # rollouts per prompt (advantages are relative within a group)
    # train on only this many of the step's groups, those whose rewards differ most (the largest
    # within-group std; None: all): groups whose videos all score alike carry no advantage to learn
    train_groups: int | None = Field(None, gt=0)
    rollout_steps: int = Field(10, gt=0)  # ODE steps of the old policy's rollouts (the card's sampler)
    # a group's videos are variations of one seed (the request's variation_seed / variation_strength
    # at this strength; None: independent seeds, as published). Their start positions nearly agree
    # (the shapes model at 0.15: 1.8 px std within a group vs 6.6 px), so a group's advantages rank how
    # well the same layout is drawn rather than where the object starts
    group_variation: float | None = Field(None, gt=0, le=1)
    save_records: bool = False  # write each step's rollout records under output_dir/rollouts/step-N
    # CFG scale of each group's rollouts, cycled over the step's groups ([1.0]: no CFG, as published).
    # A group rolled out at g > 1 trains the guided velocity v_u + g (v_c - v_u) of the student (cond
    # and unconditional branches, the card's negative prompt), of the old policy and of the reference
    rollout_guidance: list[float] = [1.0]
    # which student branches a guided group's loss reaches ("both"; "uncond": only the unconditional
    # forward carries gradient, the conditional one is the student's, detached)
    guided_grad: Literal["both", "uncond"] = "both"
    # a guided group's loss is weighted g ** -guided_loss_power (0: as a guidance-1 group's). A step
    # moves the guided velocity v_u + g (v_c - v_u) about g^2 times as far along the branches'
    # difference as it moves a guidance-1 velocity, so 2 gives guided samples a comparable step
    guided_loss_power: float = Field(0.0, ge=0)
    sampler: str | None = None  # the rollout sampler (default: the card's)
    # the noise levels trained on: ``rollout_steps`` uniform levels from 1 down, shifted by this as the
    # flow sampler shifts its schedule (3.0: the shapes card's own; 1.0: the uniform grid)
    flow_shift: float = Field(3.0, gt=0)
    # the highest level before the shift (1.0: the whole schedule, as published; lower trains only
    # where x_t already fixes the layout, so the r-weighted pulls act on details, not on positions)
    max_level: float = Field(1.0, gt=0, le=1)
    train_timesteps: int | None = Field(None, gt=0)  # levels per sample (None: floor(0.99 * rollout_steps))
    # common random numbers: a group's members are forward-noised with the same eps at the same levels.
    # Their r - 1/2 sum to about 0 within a group, so the eps part of the x0 errors (most of the
    # error at high noise) cancels out of the policy gradient instead of adding variance; each
    # sample's expected gradient is unchanged. False: fresh eps and levels per sample (published)
    shared_noise: bool = False
    max_sequence_length: int | None = Field(None, gt=0)  # prompt padding (default: the card's)
    # the student trains LoRA adapters of this rank instead of every weight (None: a full fine-tune);
    # the published recipe trains LoRA. fv_train_nft.lora
    lora_rank: int | None = Field(None, gt=0)
    lora_alpha: float | None = Field(None, gt=0)  # adapter scale alpha / rank (default: alpha = rank)
    lora_targets: list[str] = ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"]
    beta: float = Field(1.0, gt=0)  # v+ = (1-beta) v_old + beta v, v- = (1+beta) v_old - beta v
    kl_weight: float = Field(1e-4, ge=0)  # velocity distance to the frozen reference
    adv_clip_max: float = Field(5.0, gt=0)  # r = 1/2 + clip(A / adv_clip_max, -1, 1) / 2
    global_std: bool = True  # normalise advantages by the whole batch's reward std (else the group's)
    adaptive_weight: bool = True  # divide each x0 error by its (stop-grad) mean absolute value
    eta_rate: float = Field(0.001, ge=0)  # old <- eta old + (1-eta) student, eta = min(rate * step, max)
    eta_max: float = Field(0.5, ge=0, lt=1)
    eta_flat: int = Field(0, ge=0)  # steps with eta = 0 before the ramp
    eval_prompts: list[str] = []  # prompts of the evaluations (default: the training prompts)
    eval_prompts_file: Path | None = None
    eval_seeds: int = Field(1, ge=0)  # seeds per eval prompt (0: no sampled evaluation)
    eval_steps: int = Field(30, gt=0)
    eval_guidance: list[float] = [1.0]  # guidance scales evaluated (the rollouts themselves use none)
    eval_rewards: dict[str, RewardSpec] = {}  # extra scalar metrics, e.g. shape accuracy

    @model_validator(mode="after")
    def _prompt_source(self) -> NftOptions:
        if bool(self.prompts) == (self.prompts_file is not None):
            raise ValueError(
                "set exactly one of prompts (a list) and prompts_file (one prompt per line); got "
                f"{len(self.prompts)} prompts and prompts_file={self.prompts_file}"
            )
        if self.train_groups is not None and self.train_groups > self.prompts_per_step:
            raise ValueError(
                f"train_groups={self.train_groups} exceeds prompts_per_step={self.prompts_per_step}"
            )
        if not self.rollout_guidance or min(self.rollout_guidance) < 1.0:
            raise ValueError(f"rollout_guidance={self.rollout_guidance} must list scales >= 1.0")
        if self.eval_prompts and self.eval_prompts_file is not None:
            raise ValueError("set at most one of eval_prompts and eval_prompts_file")
        return self


def read_prompts(inline: list[str], path: Path | None, option: str) -> list[str]:
    """The inline prompts, else the file's (``fv_core.training.read_prompts``)."""
    return list(inline) if path is None else read_file_prompts(path, option)
