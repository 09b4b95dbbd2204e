"""fv-train-flow's pluggy hooks: the ``flow`` and ``vae`` training methods, the option schema, the
``shapes-detector`` reward and scorer, the ``shapes-best-of-n`` workflow, the ``shapes`` dataset and the
``fv eval`` command."""

from __future__ import annotations

from collections.abc import Callable

from fv_core.extend import hookimpl

PLUGIN = "fv-train-flow"


@hookimpl
def fv_register_methods(register: Callable[..., None]) -> None:
    register("flow", "fv_train_flow.method:FlowMethod")
    register("vae", "fv_train_flow.vae:VaeMethod")


@hookimpl
def fv_register_rewards(register: Callable[..., None]) -> None:
    register("shapes-detector", "fv_train_flow.reward:ShapesDetectorReward")


@hookimpl
def fv_register_scorers(register: Callable[..., None]) -> None:
    register("shapes-detector", "fv_train_flow.reward:ShapesDetectorReward")


@hookimpl
def fv_register_workflows(register: Callable[..., None]) -> None:
    # 4 candidates of the shapes model; the detector keeps the one that follows the prompt best
    register(
        "shapes-best-of-n",
        {
            "description": "the shapes model's best of 4 candidates by the shapes detector",
            "params": {"prompt": None, "seed": 0, "guidance_scale": 4.0, "num_inference_steps": 30},
            "stages": [
                {
                    "name": "candidates",
                    "model": "wan2.1-t2v-shapes",
                    "task": "t2v",
                    "bind": {
                        "prompt": "request.prompt",
                        "seed": "request.seed",
                        "guidance_scale": "request.guidance_scale",
                        "num_inference_steps": "request.num_inference_steps",
                    },
                    "fan_out": 4,
                    "select": "shapes-detector",
                }
            ],
        },
    )


@hookimpl
def fv_register_options(register: Callable[..., None]) -> None:
    register(PLUGIN, "fv_train_flow.config:FlowOptions")  # lazy: imported when a deploy or load reads it


@hookimpl
def fv_register_commands(register: Callable[..., None]) -> None:
    register("eval", "fv_train_flow.cli:add_eval_parser")


@hookimpl
def fv_register_datasets(register: Callable[..., None]) -> None:
    register("shapes", "fv_train_flow.shapes:ShapesDataset")
