"""The shipped DMD2 students of the shapes model: they load, generate, share their parent's files and
refuse what their recipe does not allow (the FastWan recipe teeth)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import fv_core
from fv_core import RecipeLoopMismatch
from fv_core.weights import component_folder

STUDENTS = {1: [1000], 2: [1000, 750]}


@pytest.fixture(scope="module", params=sorted(STUDENTS))
def student(request):
    steps = request.param
    return steps, fv_core.load(f"wan2.1-t2v-shapes-{steps}step")


def test_recipe_names_teacher_method_and_steps(student):
    steps, model = student
    card = model.card
    assert card.recipe.method == "dmd2" and card.recipe.parents == ["wan2.1-t2v-shapes"]
    assert card.recipe.assumes_loop == f"dmd{steps}" and set(card.loops) == {f"dmd{steps}"}
    loop = card.loops[f"dmd{steps}"]
    assert loop.samplers == ["dmd"] and loop.steps.fixed_timesteps == STUDENTS[steps]
    assert loop.steps.min_steps == loop.steps.max_steps == steps
    recipe = json.loads((Path(model.weights) / "fv_recipe.json").read_text())
    assert recipe["method"] == "dmd2" and recipe["parents"] == ["wan2.1-t2v-shapes"]
    assert recipe["teacher"]["card"] == "wan2.1-t2v-shapes" and recipe["teacher"]["steps"] == 30
    assert recipe["steps"] == steps and recipe["timesteps"] == STUDENTS[steps]


def test_ships_only_its_transformer_and_shares_the_parents_files(student):
    _, model = student
    folder, parent = Path(model.weights), Path(fv_core.load("wan2.1-t2v-shapes").weights)
    assert sorted(p.name for p in folder.iterdir() if p.is_dir()) == ["transformer"]
    for name in ("vae", "text_encoder", "tokenizer", "scheduler"):
        assert component_folder(folder, name).resolve() == (parent / name).resolve()
    assert (
        model.instance.weights_versions["vae"]
        == fv_core.load("wan2.1-t2v-shapes").instance.weights_versions["vae"]
    )


def test_generates_at_its_defaults(student):
    steps, model = student
    result = model.generate(prompt="a red circle moving left", seed=1)
    frames = result.frames
    assert tuple(frames.shape) == (9, 64, 64, 3) and np.isfinite(frames).all()


def test_refuses_other_step_counts_and_samplers(student):
    steps, model = student
    with pytest.raises(RecipeLoopMismatch, match=f"exactly {steps} steps at timesteps"):
        model.prepare({"prompt": "a cat", "num_inference_steps": 30})
    with pytest.raises(RecipeLoopMismatch, match="dmd"):
        model.prepare({"prompt": "a cat", "sampler": "unipc"})


def test_a_student_card_runs_on_a_retrained_self_contained_folder(student, tmp_path):
    """`fv eval --model wan2.1-t2v-shapes-2step --weights <a run's final/>`: the card binds to a folder
    holding every component itself as to the shipped one that shares its parent's."""
    from fv_core.training import train_adapter

    _, model = student
    train_adapter(model).export(tmp_path / "final", {}, {"method": "test"})
    again = fv_core.load(model.card.model_id, tmp_path / "final")
    assert again.instance.weights_versions == model.instance.weights_versions
    first = model.generate(prompt="a red circle moving left", seed=1).frames
    assert np.array_equal(again.generate(prompt="a red circle moving left", seed=1).frames, first)
