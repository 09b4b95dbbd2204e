"""The options every DMD-style distillation method shares (``fv_core.training.dmd``): the student's
fixed timesteps, the critic's update ratio, the noise-level draws, and the optional GAN and regression terms."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator, model_validator

from fv_core.training.config import StrictModel


class DMDOptions(StrictModel):
    """The options every DMD-style method takes (a config's ``options:`` section)."""

    teacher: str = "wan2.1-t2v-shapes"  # card id of the frozen teacher (the real score)
    teacher_weights: Path | None = None  # its checkpoint folder (default: the card's own weights)
    student_weights: Path | None = None  # a checkpoint to start the student from (default: the teacher's)
    prompts: Path  # text file, one prompt per line (data-free: only prompts are needed)
    # The student's fixed timesteps (of num_train_timesteps), first to last: what its card pins.
    timesteps: list[int] = Field(default_factory=lambda: [1000, 750], min_length=1)
    critic_steps_per_generator: int = Field(5, ge=1)  # TTUR: a generator update every N critic updates
    critic_lr: float | None = Field(None, gt=0)  # the critic's learning rate (default: optim.lr)
    real_guidance: float = Field(1.0, ge=1.0)  # CFG scale of the teacher's (real) score
    # Noise levels of the distribution-matching and critic losses: uniform in [min_sigma, max_sigma],
    # then the teacher's flow shift s*u / (1 + (s-1)*u) (the levels it was trained and samples at).
    min_sigma: float = Field(0.02, gt=0, lt=1)
    max_sigma: float = Field(0.98, gt=0, lt=1)
    shift: float = Field(3.0, gt=0)
    # A share of those levels drawn uniformly in [min_sigma, detail_max_sigma] instead (0: off). Low levels
    # carry fine detail (a square's corners) that the shifted draw rarely reaches; the shifted draw's high
    # levels keep the layout's spread (low levels alone collapse it).
    detail_fraction: float = Field(0.0, ge=0, lt=1)
    detail_max_sigma: float = Field(0.3, gt=0, lt=1)
    eval_prompts: int = Field(8, gt=0)  # prompts (fixed noise) of the cheap evaluation
    eval_sigmas: list[float] = Field(default_factory=lambda: [0.3, 0.6, 0.9], min_length=1)
    # Regression onto the teacher's ODE (DMD's regression loss, CausVid's initialisation; off at 0): the
    # student predicts the teacher's own sample of fresh noise (from that noise at its first step, from the
    # sample re-noised at later ones), which ties its map from noise to video to the teacher's (where
    # things start, how shapes look), not only its distribution. The teacher samples at guidance 1,
    # whatever real_guidance the distribution matching uses.
    regression_weight: float = Field(0.0, ge=0)
    regression_steps: int = Field(30, ge=1)  # Euler steps of the teacher's ODE per regression pair
    # DMD2's GAN term (off at weights 0): real clips from the dataset ``gan_data`` (registered by a plugin,
    # e.g. fv-train-flow's ``shapes``), the weights of the student's and the critic's GAN losses.
    gan_data: str | None = None
    gan_generator_weight: float = Field(0.0, ge=0)
    gan_critic_weight: float = Field(0.0, ge=0)
    gan_head_lr_scale: float = Field(1.0, gt=0)  # the fresh head's learning rate over the critic's
    gan_max_sigma: float | None = Field(None, gt=0, lt=1)  # the GAN's noise levels' top (default max_sigma)
    # An EMA of the student, updated after each generator step and exported instead of it (off: None).
    ema_decay: float | None = Field(None, ge=0, lt=1)
    ema_start: int = Field(0, ge=0)  # generator updates before the EMA starts (it copies until then)

    @field_validator("timesteps")
    @classmethod
    def _decreasing(cls, value: list[int]) -> list[int]:
        if any(t <= 0 or t > 1000 for t in value) or any(
            a <= b for a, b in zip(value, value[1:], strict=False)
        ):
            raise ValueError(
                f"timesteps={value} must be strictly decreasing integers in (0, 1000] (the student's fixed "
                "steps, first to last). Fix: e.g. [1000] for one step or [1000, 750, 500, 250] for four"
            )
        return value

    @model_validator(mode="after")
    def _range(self) -> DMDOptions:
        if self.min_sigma >= self.max_sigma:
            raise ValueError(
                f"min_sigma={self.min_sigma} must be below max_sigma={self.max_sigma}. Fix: e.g. "
                "min_sigma: 0.02, max_sigma: 0.98"
            )
        if self.detail_fraction and self.detail_max_sigma <= self.min_sigma:
            raise ValueError(
                f"detail_max_sigma={self.detail_max_sigma} must be above min_sigma={self.min_sigma}. Fix: e.g. "
                "detail_max_sigma: 0.3"
            )
        if self.gan_max_sigma is not None and self.gan_max_sigma <= self.min_sigma:
            raise ValueError(
                f"gan_max_sigma={self.gan_max_sigma} must be above min_sigma={self.min_sigma}. Fix: e.g. "
                "gan_max_sigma: 0.3"
            )
        if self.gan_generator_weight > 0 and self.gan_critic_weight == 0:
            raise ValueError(
                f"gan_generator_weight={self.gan_generator_weight} with gan_critic_weight=0: nothing would "
                "train the GAN head the student learns to fool. Fix: set gan_critic_weight above 0"
            )
        weighted = self.gan_generator_weight > 0 or self.gan_critic_weight > 0
        if weighted != (self.gan_data is not None):
            raise ValueError(
                f"gan_data={self.gan_data!r} with gan_generator_weight={self.gan_generator_weight} and "
                f"gan_critic_weight={self.gan_critic_weight}: the GAN term needs both real clips and a "
                "weight. Fix: set gan_data to a registered dataset (e.g. shapes) and a weight above 0, or "
                "neither"
            )
        return self

    @property
    def gan(self) -> bool:
        return self.gan_data is not None
