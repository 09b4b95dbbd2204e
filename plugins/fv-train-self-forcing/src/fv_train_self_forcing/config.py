"""Options of the ``self_forcing`` method (a config's ``options:`` section; the rest of the config is the
core's ``fv_core.training.TrainConfig``).

The chunking fields (``timesteps``, ``flow_shift``, ``chunk_frames``, ``context_timestep``,
``window_frames``, ``sink_frames``) are the causal card's loop the student is trained for: they must
equal the defaults of the card that will serve it (its recipe records them).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator, model_validator

from fv_core.training import StrictModel


class SelfForcingOptions(StrictModel):
    """Self-forcing of a causal student of ``teacher`` (initialised from the teacher's weights)."""

    teacher: str = "wan2.1-t2v-shapes"  # card id of the frozen bidirectional teacher (the real score)
    teacher_weights: Path | None = None  # its checkpoint folder (default: the card's own weights)
    student_weights: Path | None = None  # a checkpoint to start the student from (default: the teacher's)
    prompts: Path  # text file, one prompt per line (data-free: only prompts are needed)
    num_frames: int | None = Field(None, gt=0)  # video frames of a training rollout (default: teacher's)
    # The causal loop's fixed timesteps per chunk (of num_train_timesteps) first to last, under flow_shift.
    timesteps: list[int] = Field(default_factory=lambda: [1000, 750, 500, 250], min_length=1)
    flow_shift: float = Field(3.0, gt=0)
    chunk_frames: int = Field(1, ge=1)  # latent frames per chunk
    context_timestep: int = Field(0, ge=0, le=1000)  # a finished chunk is re-run into the cache at it
    window_frames: int = Field(3, ge=1)  # latent frames the KV context holds at most
    sink_frames: int = Field(1, ge=0)  # first latent frames the rolling window always keeps
    critic_steps_per_generator: int = Field(5, ge=1)  # TTUR: a generator update every N critic updates
    critic_lr: float | None = Field(None, gt=0)  # the critic's learning rate (default: optim.lr)
    real_guidance: float = Field(1.0, ge=1.0)  # CFG scale of the teacher's (real) score
    # Noise levels of the distribution-matching and critic losses: uniform in [min_sigma, max_sigma],
    # then the teacher's flow shift s*u / (1 + (s-1)*u).
    min_sigma: float = Field(0.02, gt=0, lt=1)
    max_sigma: float = Field(0.98, gt=0, lt=1)
    shift: float = Field(3.0, gt=0)
    ema_decay: float = Field(0.99, ge=0, lt=1)  # EMA of the student, updated after each generator step
    ema_start: int = Field(0, ge=0)  # generator updates before the EMA starts (it copies until then)
    eval_prompts: int = Field(8, gt=0)  # prompts (fixed noise) of the cheap evaluation
    eval_sigmas: list[float] = Field(default_factory=lambda: [0.3, 0.6, 0.9], min_length=1)

    @field_validator("timesteps")
    @classmethod
    def _decreasing(cls, value: list[int]) -> list[int]:
        if any(t <= 0 or t > 1000 for t in value) or any(
            a <= b for a, b in zip(value, value[1:], strict=False)
        ):
            raise ValueError(
                f"timesteps={value} must be strictly decreasing integers in (0, 1000] (the causal loop's "
                "fixed steps per chunk, first to last). Fix: e.g. [1000, 750, 500, 250]"
            )
        return value

    @model_validator(mode="after")
    def _consistent(self) -> SelfForcingOptions:
        if self.min_sigma >= self.max_sigma:
            raise ValueError(
                f"min_sigma={self.min_sigma} must be below max_sigma={self.max_sigma}. Fix: e.g. "
                "min_sigma: 0.02, max_sigma: 0.98"
            )
        if self.sink_frames + self.chunk_frames > self.window_frames:
            raise ValueError(
                f"window_frames={self.window_frames} cannot hold sink_frames={self.sink_frames} plus a chunk "
                f"of chunk_frames={self.chunk_frames}. Fix: window_frames >= "
                f"{self.sink_frames + self.chunk_frames}"
            )
        return self
