"""Assembly: a model plugin's card plus what other plugins registered for it."""

from __future__ import annotations

from typing import Any

from fv_core.card.spec import CardVariant, ModelCard
from fv_core.card.validate import validate_card
from fv_core.errors import CardValidationError
from fv_core.registry import Registries, resolve_lazy
from fv_core.request.params import schema_with_defaults

DEFAULT_KERNELS = {"attention": "sdpa"}


def kernel_variants(registries: Registries) -> dict[str, list[str]]:
    """op -> registered variants."""
    out: dict[str, set[str]] = {}
    key: Any
    for key in registries.kernels:
        op, _device, _arch, variant = key
        out.setdefault(str(op), set()).add(str(variant))
    return {op: sorted(v) for op, v in sorted(out.items())}


def interceptor_kind(registries: Registries, name: str) -> str:
    """An interceptor's kind (``step_skip``, ``block_skip``, ``observer``), read from its ``kind`` attribute."""
    return str(getattr(registries.interceptors.get(name), "kind", "observer"))


def assemble_card(registries: Registries, model_id: str) -> ModelCard:
    """The registered card (a variant built on its parent) with default kernels filled in, validated."""
    card: Any = registries.cards.get(model_id)
    card = card() if callable(card) and not isinstance(card, ModelCard | CardVariant) else card
    if isinstance(card, CardVariant):
        return derive_card(assemble_card(registries, card.parent), card)
    return complete_card(card)


def complete_card(card: ModelCard) -> ModelCard:
    """A copy of ``card`` with the default kernels filled in, validated (its defaults name real params)."""
    card = card.model_copy(deep=True)
    for op, variant in DEFAULT_KERNELS.items():
        card.kernels.setdefault(op, variant)
    return check_defaults(validate_card(card))


def derive_card(parent: ModelCard, variant: CardVariant) -> ModelCard:
    """``parent`` with the variant's id, description and defaults (same weights, loops, components)."""
    card = parent.model_copy(deep=True)
    card.model_id, card.parent = variant.model_id, parent.model_id
    card.description = variant.description or parent.description
    for task, defaults in variant.defaults.items():
        if task not in card.programs:
            raise CardValidationError(
                variant.model_id,
                f"defaults.{task}",
                f"{parent.model_id!r} has no task {task!r}",
                f"use one of its tasks {card.tasks}",
            )
        card.programs[task].defaults.update(defaults)
    return check_defaults(validate_card(card))


def check_defaults(card: ModelCard) -> ModelCard:
    """Every program default names a field of its loop's Params."""
    for task, program in card.programs.items():
        fields = resolve_lazy(card.params_of(task)).model_fields
        unknown = sorted(set(program.defaults) - set(fields))
        if unknown:
            raise CardValidationError(
                card.model_id,
                f"programs.{task}.defaults",
                f"{unknown} are not request params (the loop's Params take {sorted(fields)})",
                "remove them or fix their spelling",
            )
    return card


def describe_card(registries: Registries, model_id: str) -> dict[str, Any]:
    """What ``fv cards`` shows for one card: the card, who registered it, what can plug into it."""
    info: dict[str, Any] = {"model_id": model_id, "registered_by": registries.cards.entries[model_id].plugin}
    try:
        card = assemble_card(registries, model_id)
    except Exception as exc:
        info["error"] = f"{type(exc).__name__}: {exc}"
        return info
    accepted = card.capabilities.interceptors | {"observer"}
    info.update(
        family=card.family,
        description=card.description,
        parent=card.parent,
        tasks={
            task: {
                "stages": p.stages,
                "outputs": p.outputs,
                "accepts": card.loops[p.stages[0]].accepts,
                "params": schema_with_defaults(resolve_lazy(card.params_of(task)), p.defaults),
            }
            for task, p in card.programs.items()
        },
        loops={k: {"kind": v.kind.value, "steps": v.steps.model_dump()} for k, v in card.loops.items()},
        recipe=card.recipe.model_dump(),
        kernels=card.kernels,
        weights_repo=card.weights_repo,
        kernels_available=kernel_variants(registries),
        interceptors_available=sorted(
            str(n) for n in registries.interceptors if interceptor_kind(registries, str(n)) in accepted
        ),
        card=card.model_dump(mode="json"),
    )
    return info
