"""Load any card on its weights and turn user parameters into runnable jobs.

Model-agnostic: the card names its instance factory, its loops' factories
and its embedded weights; the model plugin supplies them.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fv_core.card.spec import ModelCard
from fv_core.errors import ConfigError
from fv_core.loop.contracts import Loop
from fv_core.registry import resolve_lazy
from fv_core.request.request import Request


@dataclass
class LoadedModel:
    """A card bound to a live instance: the unit a server or CLI runs requests on."""

    card: ModelCard  # the assembled card
    instance: Any  # live components, shared by every request
    weights: str  # checkpoint folder
    plugin: str | None = None  # distribution that registered the card (for provenance)

    def loop(self, loop_id: str | None = None) -> Loop:
        """A fresh loop object (loops are stateless; state lives in LoopState)."""
        spec = self.card.loops[loop_id or self.card.recipe.assumes_loop]
        return resolve_lazy(spec.loop_factory)()

    def job(
        self, params: dict[str, Any], seed: int = 0, task: str | None = None
    ) -> tuple[Loop, Request, Any]:
        """``(loop, request, instance)`` for the engine; frames == 1 makes an image task."""
        if task is None:
            task = "text_to_image" if params.get("num_frames") == 1 else "text_to_video"
        if task not in self.card.capabilities.tasks:
            raise ConfigError(
                f"model {self.card.model_id!r} does not serve task {task!r}; it serves "
                f"{sorted(self.card.capabilities.tasks)}. Fix: ask for one of those."
            )
        request = Request(request_id=uuid.uuid4().hex[:16], task=task, params=dict(params), seed=seed)
        return self.loop(params.get("loop")), request, self.instance


def load_model(
    card: ModelCard, weights: str | Path | None = None, device: str = "cpu", plugin: str | None = None
) -> LoadedModel:
    """Materialize ``card`` on ``weights`` (its embedded weights when omitted)."""
    if card.instance_factory is None:
        raise ConfigError(f"card {card.model_id!r} names no instance_factory; its plugin cannot load it.")
    if weights is None:
        if card.default_weights is None:
            raise ConfigError(
                f"model {card.model_id!r} has no embedded weights. Fix: pass a weights folder (--weights DIR)."
            )
        weights = resolve_lazy(card.default_weights)()
    instance = resolve_lazy(card.instance_factory)(card, weights, device)
    return LoadedModel(card, instance, str(weights), plugin)
