"""Options of the ``self_forcing`` method (a config's ``options:`` section; the rest of the config is the
core's ``fv_core.training.TrainConfig``).

The chunking fields (``timesteps``, ``flow_shift``, ``chunk_frames``, ``context_timestep``,
``window_frames``, ``sink_frames``) are the causal card's loop the student is trained for: they must
equal the defaults of the card that will serve it (its recipe records them).
"""

from __future__ import annotations

from pydantic import Field, model_validator

from fv_core.training import DMDOptions


class SelfForcingOptions(DMDOptions):
    """Self-forcing of a causal student of ``teacher`` (initialised from the teacher's weights): the core's
    DMD options plus the causal loop's chunking, the rollout length and the EMA."""

    num_frames: int | None = Field(None, gt=0)  # video frames of a training rollout (default: teacher's)
    # The causal loop's fixed timesteps per chunk (of num_train_timesteps) first to last, under flow_shift.
    timesteps: list[int] = Field(default_factory=lambda: [1000, 750, 500, 250], min_length=1)
    flow_shift: float = Field(3.0, gt=0)
    chunk_frames: int = Field(1, ge=1)  # latent frames per chunk
    context_timestep: int = Field(0, ge=0, le=1000)  # a finished chunk is re-run into the cache at it
    window_frames: int = Field(3, ge=1)  # latent frames the KV context holds at most
    sink_frames: int = Field(1, ge=0)  # first latent frames the rolling window always keeps
    ema_decay: float = Field(0.99, ge=0, lt=1)  # always kept here (the core's is optional)

    @model_validator(mode="after")
    def _window(self) -> SelfForcingOptions:
        if self.sink_frames + self.chunk_frames > self.window_frames:
            raise ValueError(
                f"window_frames={self.window_frames} cannot hold sink_frames={self.sink_frames} plus a chunk "
                f"of chunk_frames={self.chunk_frames}. Fix: window_frames >= "
                f"{self.sink_frames + self.chunk_frames}"
            )
        return self
