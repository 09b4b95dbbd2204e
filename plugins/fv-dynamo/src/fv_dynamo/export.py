"""What a worker publishes for routing: one served model's deployment card and the calibrated cost model.

One object, two consumers: fv's own scheduler prices work with this cost model, and Dynamo gets the same
numbers. It goes into the model's registration (``user_data["fv"]`` of the model card Dynamo keeps in
etcd, read by any router or planner) and, live, from the worker's ``routing`` endpoint, as the engine
recalibrates. A request's predicted seconds per step of loop ``L`` are
``(base_s + per_token_s * tokens) * ratio`` of ``L``'s calibrations.

The live endpoint adds ``load``: the predicted seconds of the work the worker holds now (``backlog``),
what ``fv_dynamo.router.CostRouter`` routes by.
"""

from __future__ import annotations

import asyncio
from typing import Any

ROUTING_KEY = "fv"  # the user_data key of the registration


def routing_card(service: Any, name: str) -> dict[str, Any]:
    """The served model ``name``'s deployment card and the engine's calibrated cost model, as JSON data.

    ``service`` is the running fv server's service (``app.state.service``)."""
    served = service.models[name]
    deploy = service.deploy.model_dump(mode="json", exclude={"models"})
    card = served.loaded.card
    return {
        "model": name,
        "deployment": {**deploy, "model": served.deploy.model_dump(mode="json")},
        "card": {
            "id": card.model_id,
            "family": card.family,
            "tasks": {task: list(program.outputs) for task, program in card.programs.items()},
        },
        "cost_model": cost_model(service.engine.engine.cost, card.loops),
        "queue_depth": service.queue_depth,
    }


def cost_model(cost: Any, loops: dict[str, Any]) -> dict[str, Any]:
    """A ``fv_core.runtime.CostModel`` as data for the card's ``loops``: each loop's step cost (the
    card's), its online calibrations (actual / predicted per loop, unit kind and model instance) and
    measured batch curves (the engine's cost model covers every model it serves: the other models'
    loops are left out), and the engine's prediction accuracy so far."""
    return {
        "step_cost": {loop_id: spec.step_cost.model_dump(mode="json") for loop_id, spec in loops.items()},
        "calibrations": [
            {"loop": key[0], "kind": key[1], "instance": str(key[2]), "ratio": c.ratio, "samples": c.samples}
            for key, c in cost.calibrations().items()
            if key[0] in loops
        ],
        "batch_curves": [
            {"loop": key[0], "kind": key[1], "batch_key": str(key[2]), "seconds_by_rows": curve.seconds}
            for key, curve in cost.curves().items()
            if curve.seconds and key[0] in loops
        ],
        "accuracy": cost.accuracy(),
    }


def backlog(scheduler: Any) -> dict[str, float]:
    """The engine's held work in predicted seconds (the cost model's, calibrated), read between two ticks:
    an admitted request's remaining reservation, a waiting one's estimate of its current stage, and a
    request not estimated yet at the mean of the others."""
    running, known, unknown = scheduler.admission.running, [], 0
    for request_id, entry in scheduler.entries.items():
        if request_id in running:
            known.append(running[request_id].compute_s)
        elif entry.need is not None:
            known.append(entry.need.compute_s)
        else:
            unknown += 1
    mean = sum(known) / len(known) if known else 0.0
    return {"queued_s": sum(known) + unknown * mean, "requests": len(known) + unknown}


async def load(service: Any) -> dict[str, float]:
    """``backlog`` of the running fv server's engine (at its next step boundary), with its job count."""
    held = await asyncio.wrap_future(service.engine.at_boundary(backlog))
    return {**held, "queue_depth": service.queue_depth}


def workflow_card(service: Any, workflow_id: str) -> dict[str, Any]:
    """A served workflow's registration data: its stages and the served models they run on."""
    flow = service.workflows[workflow_id]
    return {
        "workflow": workflow_id,
        "deployment": service.deploy.model_dump(mode="json", exclude={"models"}),
        "spec": flow.spec.model_dump(mode="json"),
        "output": workflow_output(flow),
    }


def workflow_output(flow: Any) -> str:
    """What a workflow makes: its last stage's output (``video``, ``image``), through nested workflows."""
    stage = flow.spec.stages[-1]
    inner = flow.models[stage.model]
    if hasattr(inner, "spec"):  # a nested workflow
        return workflow_output(inner)
    programs = inner.card.programs
    return str(programs[stage.task or next(iter(programs))].outputs[0])
