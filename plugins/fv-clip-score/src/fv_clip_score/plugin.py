"""fv-clip-score's pluggy hooks: ``clip-score`` as a workflow scorer and a training reward."""

from __future__ import annotations

from collections.abc import Callable

from fv_core.extend import hookimpl

SCORER = "fv_clip_score.scorer:ClipScorer"


@hookimpl
def fv_register_scorers(register: Callable[..., None]) -> None:
    register("clip-score", SCORER)


@hookimpl
def fv_register_rewards(register: Callable[..., None]) -> None:
    register("clip-score", SCORER)
