import pytest

from fv_core import CardValidationError, ConfigError, RecipeLoopMismatch
from fv_core.card import (
    CacheContract,
    ComponentSpec,
    RecipeSpec,
    StepsContract,
    card_from_dict,
    check_loop_request,
    validate_card,
)
from tests.core.conftest import make_card


def test_valid_card_passes():
    assert validate_card(make_card()).model_id == "toy"


def loop_with(**changes):
    card = make_card()
    loop = card.loops["denoise"].model_copy(update=changes)
    return make_card(loops={"denoise": loop})


@pytest.mark.parametrize(
    ("card", "field", "fix"),
    [
        (lambda: make_card(loops={}), "loops", "declare at least one LoopSpec"),
        (lambda: loop_with(loop_factory="no_colon"), "loops.denoise.loop_factory", "package.module:callable"),
        (
            lambda: loop_with(components=["dit", "text_encoder"]),
            "loops.denoise.components",
            "add 'text_encoder'",
        ),
        (lambda: loop_with(shared_weight_components=["llm"]), "loops.denoise.components", "add 'llm'"),
        (lambda: loop_with(cache_policy=["kv"]), "loops.denoise.cache_policy", "CacheContract named 'kv'"),
        (
            lambda: loop_with(steps=StepsContract(min_steps=5, max_steps=2)),
            "loops.denoise.steps",
            "min_steps <=",
        ),
        (
            lambda: loop_with(steps=StepsContract(min_steps=1, max_steps=2, fixed_timesteps=[999, 757, 522])),
            "loops.denoise.steps.fixed_timesteps",
            "admit the fixed timesteps",
        ),
        (
            lambda: make_card(recipe=RecipeSpec(assumes_loop="decode")),
            "recipe.assumes_loop",
            "loop the weights",
        ),
        (
            lambda: make_card(recipe=RecipeSpec(assumes_loop="denoise", assumes_precision="fp8")),
            "recipe.assumes_precision",
            "precision.supported",
        ),
        (
            lambda: make_card(
                components={"dit": ComponentSpec(kind="dit", load_id="a:b", required_for={"i2v"})}
            ),
            "components.dit.required_for",
            "declare the task in programs",
        ),
        (
            lambda: make_card(
                caches={"text": CacheContract(kind="feature", key_fields=["model"], component="umt5")}
            ),
            "caches.text.component",
            "weights version",
        ),
        (
            lambda: make_card(caches={"text": CacheContract(kind="feature", key_fields=[])}),
            "caches.text.key_fields",
            "list every field",
        ),
        (
            lambda: make_card(precision={"supported": ["float32"], "default": "bfloat16"}),
            "precision.default",
            "add it",
        ),
        (lambda: make_card(parallelism={"axes": {"warp": 2}}), "parallelism.axes.warp", "use one of"),
        (lambda: make_card(parallelism={"axes": {"sp": 0}}), "parallelism.axes.sp", "at least 1"),
    ],
)
def test_each_error_names_card_field_and_fix(card, field, fix):
    with pytest.raises(CardValidationError) as info:
        validate_card(card())
    err = info.value
    assert err.card == "toy" and err.field == field
    assert fix in str(err) and str(err).startswith(f"card 'toy': {field}:")


def test_unknown_fields_rejected_from_data():
    data = make_card().model_dump()
    data["loops"]["denoise"]["num_stepz"] = 4
    with pytest.raises(
        ConfigError, match=r"card 'toy': loops.denoise.num_stepz: .*Fix: it is an unknown field; remove it"
    ):
        card_from_dict(data)


def test_recipe_teeth_refuse_other_loops_and_step_counts():
    steps = StepsContract(min_steps=3, max_steps=3, fixed_timesteps=[1000, 757, 522])
    card = loop_with(steps=steps)
    card.recipe.method = "dmd2"
    check_loop_request(card, "denoise", 3)
    with pytest.raises(
        RecipeLoopMismatch, match=r"assumes exactly 3 steps.*got 50 steps.*num_inference_steps=3"
    ):
        check_loop_request(card, "denoise", 50)
    with pytest.raises(RecipeLoopMismatch, match="not 'denoise50'"):
        check_loop_request(card, "denoise50", 3)
    open_card = loop_with(steps=StepsContract(min_steps=1, max_steps=100))
    with pytest.raises(RecipeLoopMismatch, match="runs 1..100 steps; got 500"):
        check_loop_request(open_card, "denoise", 500)
