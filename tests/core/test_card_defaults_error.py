"""Cards carry no top-level ``defaults``: setting them on a copied card is an error naming where they live."""

import pytest

from fv_core import ConfigError
from tests.core.conftest import make_card

DEFAULTS = {"t2v": {"num_inference_steps": 8}}


@pytest.mark.parametrize(
    "set_defaults",
    [
        lambda card: card.model_copy(update={"defaults": DEFAULTS}),  # pydantic keeps it, unvalidated
        lambda card: setattr(card, "defaults", DEFAULTS),
    ],
    ids=["model_copy", "setattr"],
)
def test_top_level_defaults_are_refused_with_the_fix(set_defaults):
    with pytest.raises(ConfigError) as info:
        set_defaults(make_card())
    message = str(info.value)
    assert "ModelCard has no field 'defaults'" in message and "no longer carry defaults" in message
    assert "card.programs[TASK].defaults" in message and "CardVariant(" in message  # the fix


def test_unknown_fields_name_the_known_ones_and_known_fields_still_copy():
    card = make_card()
    with pytest.raises(ConfigError, match=r"no field 'modle_id': its fields are \[.*'model_id'"):
        card.model_copy(update={"modle_id": "x"})
    copy = card.model_copy(update={"model_id": "toy-2"})
    copy.description = "a copy"
    copy.programs[copy.tasks[0]].defaults = {"num_inference_steps": 8}  # where a task's defaults live
    assert (copy.model_id, copy.description, card.model_id) == ("toy-2", "a copy", "toy")
