"""What a worker publishes for routing: one served model's deployment card and the calibrated cost model.

One object, two consumers: fv's own scheduler prices work with this cost model, and Dynamo gets the same
numbers. It goes into the model's registration (``user_data["fv"]`` of the model card Dynamo keeps in
etcd, read by any router or planner) and, live, from the worker's ``routing`` endpoint, as the engine
recalibrates. A request's predicted seconds per step of loop ``L`` are
``(base_s + per_token_s * tokens) * ratio`` of ``L``'s calibrations.
"""

from __future__ import annotations

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
