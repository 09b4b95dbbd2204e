"""Options of the ``dmd2`` method (a config's ``options:`` section; the rest of the config is the
core's ``fv_core.training.TrainConfig``)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator, model_validator

from fv_core.training import StrictModel


class DMD2Options(StrictModel):
    """DMD2 distillation of ``teacher`` into a student sampled at ``timesteps`` (one step each)."""

    teacher: str = "wan2.1-t2v-shapes"  # card id of the frozen teacher (the real score)
    teacher_weights: Path | None = None  # its checkpoint folder (default: the card's own weights)
    prompts: Path  # text file, one prompt per line (DMD2 is data-free: only prompts are needed)
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
    eval_prompts: int = Field(8, gt=0)  # prompts (fixed noise) of the cheap evaluation
    eval_sigmas: list[float] = Field(default_factory=lambda: [0.3, 0.6, 0.9], min_length=1)

    @field_validator("timesteps")
    @classmethod
    def _decreasing(cls, value: list[int]) -> list[int]:
        if any(t <= 0 or t > 1000 for t in value) or any(
            a <= b for a, b in zip(value, value[1:], strict=False)
        ):
            raise ValueError(
                f"timesteps={value} must be strictly decreasing integers in (0, 1000] (the student's "
                "fixed steps, first to last). Fix: e.g. [1000] for one step or [1000, 750] for two"
            )
        return value

    @model_validator(mode="after")
    def _range(self) -> DMD2Options:
        if self.min_sigma >= self.max_sigma:
            raise ValueError(
                f"min_sigma={self.min_sigma} must be below max_sigma={self.max_sigma}. Fix: e.g. "
                "min_sigma: 0.02, max_sigma: 0.98"
            )
        return self
