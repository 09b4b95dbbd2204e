"""Load any card on its weights and turn user parameters into runnable jobs.

Model-agnostic: the card names its instance factory, its loops' factories
and its embedded weights; the model plugin supplies them.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from fv_core.card.spec import ModelCard
from fv_core.errors import ConfigError
from fv_core.kernels_select import select_kernel
from fv_core.loop.contracts import Loop
from fv_core.registry import resolve_lazy
from fv_core.request.request import Request

if TYPE_CHECKING:
    from fv_core.plugins import PluginHost

# op -> (implementation, provenance record), as ``select_kernel`` returns them
Kernels = dict[str, tuple[Any, dict[str, Any]]]


@dataclass
class LoadedModel:
    """A card bound to a live instance: the unit a server or CLI runs requests on."""

    card: ModelCard  # the assembled card
    instance: Any  # live components, shared by every request
    weights: str  # checkpoint folder
    plugin: str | None = None  # plugin that registered the card; its distribution version goes in provenance
    interceptors: tuple[Any, ...] = ()  # enabled interceptors, attached to every request

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
        request = Request(
            request_id=uuid.uuid4().hex[:16],
            task=task,
            params=dict(params),
            seed=seed,
            interceptors=self.interceptors,
        )
        return self.loop(params.get("loop")), request, self.instance


def resolve_kernels(
    host: PluginHost,
    card: ModelCard,
    device: str = "cpu",
    plugin_options: Mapping[str, BaseModel] | None = None,
    requested: Mapping[str, str] | None = None,
) -> Kernels:
    """The card's kernels (``requested`` variants overriding, e.g. a deploy's) selected for ``device``.

    ``plugin_options`` are validated options by plugin name; a kernel gets its
    plugin's. A variant with no kernel for this device is an error listing the
    variants there are.
    """
    chosen = {**card.kernels, **(requested or {})}
    return {
        op: select_kernel(host.registries, op, variant, device, options=plugin_options)
        for op, variant in chosen.items()
    }


def build_interceptors(
    host: PluginHost, names: Sequence[str], plugin_options: Mapping[str, BaseModel] | None = None
) -> tuple[Any, ...]:
    """Interceptors by registered name, each made with its plugin's options (only the fields set)."""
    built = []
    for name in names:
        plugin = host.registries.interceptors.plugin_of(name)
        options = (plugin_options or {}).get(plugin)
        built.append(
            host.registries.interceptors.get(name)(
                **(options.model_dump(exclude_unset=True) if options else {})
            )
        )
    return tuple(built)


def load_model(
    card: ModelCard,
    weights: str | Path | None = None,
    device: str = "cpu",
    plugin: str | None = None,
    kernels: Kernels | None = None,
    interceptors: tuple[Any, ...] = (),
) -> LoadedModel:
    """Materialize ``card`` on ``weights`` (its embedded weights when omitted).

    ``kernels`` (from :func:`resolve_kernels`) reach the instance factory as its
    ``kernels`` keyword; the instance runs them and reports them per result.
    """
    if card.instance_factory is None:
        raise ConfigError(f"card {card.model_id!r} names no instance_factory; its plugin cannot load it.")
    if weights is None:
        if card.default_weights is None:
            raise ConfigError(
                f"model {card.model_id!r} has no embedded weights. Fix: pass a weights folder (--weights DIR)."
            )
        weights = resolve_lazy(card.default_weights)()
    extra = {} if kernels is None else {"kernels": kernels}
    instance = resolve_lazy(card.instance_factory)(card, weights, device, **extra)
    return LoadedModel(card, instance, str(weights), plugin, interceptors)
