"""Assembly: a model plugin's card plus what other plugins registered for it."""

from __future__ import annotations

from typing import Any

from fv_core.card.spec import ModelCard
from fv_core.card.validate import validate_card
from fv_core.registry import Registries

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
    """The registered card with default kernels filled in, validated."""
    card: Any = registries.cards.get(model_id)
    card = card() if callable(card) and not isinstance(card, ModelCard) else card
    card = card.model_copy(deep=True)
    for op, variant in DEFAULT_KERNELS.items():
        card.kernels.setdefault(op, variant)
    return validate_card(card)


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
        tasks=sorted(card.capabilities.tasks),
        loops={k: {"kind": v.kind.value, "steps": v.steps.model_dump()} for k, v in card.loops.items()},
        recipe=card.recipe.model_dump(),
        kernels=card.kernels,
        kernels_available=kernel_variants(registries),
        interceptors_available=sorted(
            str(n) for n in registries.interceptors if interceptor_kind(registries, str(n)) in accepted
        ),
        card=card.model_dump(mode="json"),
    )
    return info
