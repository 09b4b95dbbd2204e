"""A workflow checked before anything loads: its stages name served models (or workflows) and their
tasks, every binding's source exists and gives what its target takes."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from fv_core.errors import ConfigError
from fv_core.registry import resolve_lazy
from fv_core.workflow.spec import OUTPUTS, PARTS, REQUEST, WorkflowSpec


def check_workflow(
    workflow_id: str,
    workflows: Mapping[str, WorkflowSpec],
    card_of: Callable[[str], Any],
    scorers: set[str],
    seen: tuple[str, ...] = (),
) -> list[str]:
    """The outputs of ``workflow_id``'s last stage; ConfigError naming the stage and the binding at the
    first problem. ``card_of(served name)``: that model's card (KeyError: not served)."""
    if workflow_id in seen:
        raise ConfigError(
            f"workflows: {' -> '.join((*seen, workflow_id))} nests a workflow in itself. Fix: break the cycle."
        )
    spec = workflows[workflow_id]
    outputs: dict[str, list[str]] = {}
    for i, stage in enumerate(spec.stages):
        where = f"workflows.{workflow_id}.stages[{i}] ({stage.name!r})"
        if stage.name in outputs:
            raise ConfigError(
                f"{where}: the name repeats an earlier stage's. Fix: give each stage its own name."
            )
        if stage.model in workflows:
            accepts, fields, made = (
                (),
                set(workflows[stage.model].params),
                check_workflow(stage.model, workflows, card_of, scorers, (*seen, workflow_id)),
            )
        else:
            accepts, fields, made = _task(where, stage.model, stage.task, card_of)
        for target, origin, name in stage.sources():
            binding = f"{where}.bind.{target}"
            if origin == REQUEST:
                if name not in spec.params:
                    raise ConfigError(
                        f"{binding}: request.{name} is not a param of the workflow (it has {sorted(spec.params)}). "
                        f"Fix: add {name} to workflows.{workflow_id}.params."
                    )
            elif origin not in outputs or name not in OUTPUTS:
                raise ConfigError(
                    f"{binding}: {origin}.{name} names no earlier stage's output (earlier stages: {list(outputs)}; "
                    f"outputs: {list(OUTPUTS)}). Fix: bind to request.<param> or <earlier stage>.<output>."
                )
            elif name not in outputs[origin] and not (name == "image" and "video" in outputs[origin]):
                raise ConfigError(
                    f"{binding}: stage {origin!r} outputs {outputs[origin]}, no {name}. Fix: bind to what it outputs."
                )
            if target in PARTS and target not in accepts:
                raise ConfigError(
                    f"{binding}: the stage's task takes no {target} (it takes {list(accepts) or 'no input parts'}). "
                    f"Fix: use a task that takes an {target} (e.g. i2v), or drop the binding."
                )
            if target not in PARTS and target not in fields:
                raise ConfigError(
                    f"{binding}: {target} is not a param of the stage's task (it has {sorted(fields)}). "
                    "Fix: bind one of those."
                )
        if (stage.fan_out > 1) != (stage.select is not None):
            raise ConfigError(
                f"{where}: fan_out={stage.fan_out} with select={stage.select!r}; candidates need a scorer to "
                "select the best, and a select needs candidates. Fix: set both (fan_out >= 2 and select) or neither."
            )
        if stage.scorer is not None and stage.scorer.scorer not in scorers:
            raise ConfigError(
                f"{where}.select: no loaded plugin registers the scorer {stage.scorer.scorer!r} (available: "
                f"{sorted(scorers)}). Fix: name one of those, or enable the plugin that provides it."
            )
        outputs[stage.name] = made
    return outputs[spec.stages[-1].name]


def _task(
    where: str, model: str, task: str | None, card_of: Callable[[str], Any]
) -> tuple[Any, set[str], list[str]]:
    """What a served model's task accepts as parts, its params and its outputs."""
    try:
        card = card_of(model)
    except KeyError:
        raise ConfigError(
            f"{where}: model {model!r} is not served by this deploy file (nor a workflow of it). "
            "Fix: add it to models (or name a served model)."
        ) from None
    task = task or card.tasks[0]
    if task not in card.programs:
        raise ConfigError(
            f"{where}: {card.model_id!r} has no task {task!r}; its tasks are {card.tasks}. Fix: name one."
        )
    loop = card.loops[card.programs[task].stages[0]]
    params = resolve_lazy(card.params_of(task))
    return loop.accepts, set(params.model_fields), list(card.programs[task].outputs)
