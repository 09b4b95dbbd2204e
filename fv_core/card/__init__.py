"""Model cards: specs, validation and assembly."""

from fv_core.card.assemble import complete_card, derive_card
from fv_core.card.spec import (
    AdapterContract,
    CacheContract,
    CapabilityMatrix,
    CardVariant,
    ComponentSpec,
    LoopSpec,
    ModelCard,
    ParallelismContract,
    ParitySpec,
    PrecisionContract,
    ProgramSpec,
    RecipeSpec,
    StepCostModel,
    StepsContract,
)
from fv_core.card.validate import card_from_dict, check_loop_request, validate_card

__all__ = [
    "AdapterContract",
    "derive_card",
    "complete_card",
    "CacheContract",
    "CapabilityMatrix",
    "CardVariant",
    "ComponentSpec",
    "LoopSpec",
    "ModelCard",
    "ParallelismContract",
    "ParitySpec",
    "PrecisionContract",
    "ProgramSpec",
    "RecipeSpec",
    "StepCostModel",
    "StepsContract",
    "card_from_dict",
    "check_loop_request",
    "validate_card",
]
