"""Options of the ``dmd2`` method (a config's ``options:`` section; the rest of the config is the
core's ``fv_core.training.TrainConfig``): the core's DMD options as they are."""

from __future__ import annotations

from fv_core.training import DMDOptions


class DMD2Options(DMDOptions):
    """DMD2 distillation of ``teacher`` into a student sampled at ``timesteps`` (one step each)."""
