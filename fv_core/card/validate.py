"""Card validation: every reference on a card resolves, before any weight loads."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from fv_core.card.spec import ModelCard
from fv_core.errors import CardValidationError, ConfigError, RecipeLoopMismatch, explain

PARALLEL_AXES = {"dp", "tp", "sp", "cp", "cfgp", "pp_patch", "vae", "ep", "fsdp", "role", "replica"}


def card_from_dict(data: dict[str, Any]) -> ModelCard:
    """Build a card from plain data; schema errors become one ConfigError naming each field and fix."""
    name = str(data.get("model_id", "<unnamed>"))
    try:
        card = ModelCard.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(explain(exc, f"card {name!r}", ModelCard.model_fields)) from None
    return validate_card(card)


def validate_card(card: ModelCard) -> ModelCard:
    """Raise ``CardValidationError`` (card, field, fix) on the first inconsistency."""
    _check_loops(card)
    _check_programs(card)
    _check_recipe(card)
    _check_components(card)
    _check_caches(card)
    _check_contracts(card)
    _check_kernels(card)
    return card


def _check_kernels(card: ModelCard) -> None:
    for op, variant in card.kernels.items():
        if not card.accepts_kernel(op, variant):
            _fail(
                card,
                f"kernels.{op}",
                f"selects {variant!r}, which its model code does not run (accepts_kernels: {card.accepts_kernels})",
                f"select one of {card.accepts_kernels.get(op, [])} or add {variant!r} to accepts_kernels.{op}",
            )


def _fail(card: ModelCard, field: str, problem: str, fix: str) -> None:
    raise CardValidationError(card.model_id, field, problem, fix)


def _check_loops(card: ModelCard) -> None:
    if not card.loops:
        _fail(card, "loops", "the card declares no loop", "declare at least one LoopSpec")
    components = sorted(card.components)
    for loop_id, loop in card.loops.items():
        where = f"loops.{loop_id}"
        if ":" not in loop.loop_factory:
            _fail(
                card,
                f"{where}.loop_factory",
                f"{loop.loop_factory!r} is not 'module:attr'",
                "name the loop factory as 'package.module:callable'",
            )
        for name in loop.components + loop.shared_weight_components:
            if name not in card.components:
                _fail(
                    card,
                    f"{where}.components",
                    f"component {name!r} is not declared (declared: {components})",
                    f"add {name!r} to components or remove it from the loop",
                )
        if loop.variant_of is not None and loop.variant_of not in card.loops:
            _fail(
                card,
                f"{where}.variant_of",
                f"{loop.variant_of!r} is not a declared loop (declared: {sorted(card.loops)})",
                "name the loop whose weights this one shares",
            )
        for cache in loop.cache_policy:
            if cache not in card.caches:
                _fail(
                    card,
                    f"{where}.cache_policy",
                    f"cache {cache!r} is not declared (declared: {sorted(card.caches)})",
                    f"add a CacheContract named {cache!r} to caches",
                )
        steps = loop.steps
        if not 1 <= steps.min_steps <= steps.max_steps:
            _fail(
                card,
                f"{where}.steps",
                f"min_steps={steps.min_steps} max_steps={steps.max_steps}",
                "use 1 <= min_steps <= max_steps",
            )
        if (
            steps.fixed_timesteps is not None
            and not steps.min_steps <= len(steps.fixed_timesteps) <= steps.max_steps
        ):
            _fail(
                card,
                f"{where}.steps.fixed_timesteps",
                f"{len(steps.fixed_timesteps)} timesteps outside [{steps.min_steps}, {steps.max_steps}]",
                "make min_steps/max_steps admit the fixed timesteps",
            )


def _check_programs(card: ModelCard) -> None:
    if not card.programs:
        _fail(card, "programs", "the card declares no program (task)", "declare at least one ProgramSpec")
    for name, program in card.programs.items():
        unknown = [loop for loop in program.stages if loop not in card.loops]
        unbound = sorted(set(program.binds) - set(range(len(program.stages))))
        if unbound:
            _fail(
                card,
                f"programs.{name}.binds",
                f"stage indices {unbound} are not stages of {program.stages}",
                f"bind stages 0..{len(program.stages) - 1} only",
            )
        if not program.stages or unknown:
            _fail(
                card,
                f"programs.{name}.stages",
                f"stages {program.stages} must be non-empty loop ids; unknown: {unknown}",
                f"use loops declared in loops ({sorted(card.loops)})",
            )


def _check_recipe(card: ModelCard) -> None:
    recipe = card.recipe
    if recipe.assumes_loop not in card.loops:
        _fail(
            card,
            "recipe.assumes_loop",
            f"{recipe.assumes_loop!r} is not a declared loop (declared: {sorted(card.loops)})",
            "set assumes_loop to the loop the weights were made for",
        )
    if recipe.assumes_precision not in card.precision.supported:
        _fail(
            card,
            "recipe.assumes_precision",
            f"{recipe.assumes_precision!r} is not in precision.supported {card.precision.supported}",
            "add it to precision.supported",
        )


def _check_components(card: ModelCard) -> None:
    for name, comp in card.components.items():
        unknown = sorted(comp.required_for - set(card.programs))
        if unknown:
            _fail(
                card,
                f"components.{name}.required_for",
                f"tasks {unknown} are not programs of the card {sorted(card.programs)}",
                "declare the task in programs or drop it",
            )


def _check_caches(card: ModelCard) -> None:
    for name, cache in card.caches.items():
        if cache.component is not None and cache.component not in card.components:
            _fail(
                card,
                f"caches.{name}.component",
                f"component {cache.component!r} is not declared",
                "name a declared component whose weights version scopes this cache",
            )
        if not cache.key_fields:
            _fail(
                card,
                f"caches.{name}.key_fields",
                "a cache with no key fields would serve stale entries",
                "list every field that can change the cached value",
            )


def _check_contracts(card: ModelCard) -> None:
    if card.precision.default not in card.precision.supported:
        _fail(
            card,
            "precision.default",
            f"{card.precision.default!r} not in supported {card.precision.supported}",
            "add it to precision.supported",
        )
    for axis, degree in card.parallelism.axes.items():
        if axis not in PARALLEL_AXES:
            _fail(
                card,
                f"parallelism.axes.{axis}",
                f"unknown axis {axis!r}",
                f"use one of {sorted(PARALLEL_AXES)}",
            )
        if degree < 1:
            _fail(card, f"parallelism.axes.{axis}", f"degree {degree} < 1", "use a degree of at least 1")


def check_loop_request(
    card: ModelCard, loop_id: str, num_steps: int, timesteps: list[int] | None = None
) -> None:
    """Refuse to drive ``card`` with a loop or step count its recipe does not assume."""
    recipe = card.recipe
    if loop_id != recipe.assumes_loop:
        raise RecipeLoopMismatch(
            f"card {card.model_id!r} was made by {recipe.method!r} for loop {recipe.assumes_loop!r}, "
            f"not {loop_id!r}. Fix: run loop {recipe.assumes_loop!r}."
        )
    steps = card.loops[loop_id].steps
    if steps.fixed_timesteps is not None:
        if num_steps != len(steps.fixed_timesteps) or (
            timesteps is not None and timesteps != steps.fixed_timesteps
        ):
            raise RecipeLoopMismatch(
                f"card {card.model_id!r} ({recipe.method}) assumes exactly {len(steps.fixed_timesteps)} steps at "
                f"timesteps {steps.fixed_timesteps}; got {num_steps} steps. Fix: use "
                f"num_inference_steps={len(steps.fixed_timesteps)} (its weights make garbage otherwise)."
            )
    elif not steps.min_steps <= num_steps <= steps.max_steps:
        raise RecipeLoopMismatch(
            f"card {card.model_id!r} loop {loop_id!r} runs {steps.min_steps}..{steps.max_steps} steps; got "
            f"{num_steps}. Fix: choose a step count in that range."
        )
