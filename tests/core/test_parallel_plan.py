"""ParallelPlan: parsing, ids, rank layout, and every problem reported with its numbers before anything starts."""

from __future__ import annotations

import pytest

from fv_core import ConfigError
from fv_core.deploy.card import parse_deploy
from fv_core.parallel import ParallelPlan, plan_problems

WAN_AXES = {"dp": 1, "sp": 8, "cfgp": 2}


def test_parse_and_id_round_trip():
    plan = ParallelPlan.parse("cfg=2, sp=4")
    assert (plan.sequence, plan.cfg, plan.data, plan.tensor, plan.world_size) == (4, 2, 1, 1, 8)
    assert plan.id == "sp=4,cfg=2" and ParallelPlan.parse(plan.id) == plan
    assert ParallelPlan.parse(None).is_single and ParallelPlan.parse("single").id == "single"


def test_ranks_are_laid_out_sequence_innermost():
    plan = ParallelPlan.parse("sp=2,cfg=2")
    assert [plan.coords(r) for r in range(4)] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]


@pytest.mark.parametrize(
    "text, message",
    [
        ("sp=0", "'sp=0' is not AXIS=DEGREE"),
        ("pp=2", "'pp=2' is not AXIS=DEGREE with AXIS one of \\['cfg', 'dp', 'sp', 'tp'\\]"),
        ("sp=2,sp=4", "names 'sp' twice"),
    ],
)
def test_bad_text_says_what_is_wrong(text, message):
    with pytest.raises(ConfigError, match=message):
        ParallelPlan.parse(text)


def test_every_problem_is_listed_with_its_numbers():
    plan = ParallelPlan.parse("sp=3,cfg=4")
    problems = plan_problems(plan, card_axes=WAN_AXES, heads=12, branches=2, devices=8, device="cuda")
    assert problems == [
        "cfg degree 4 exceeds the card's maximum 2 (parallelism.axes.cfgp). Fix: use cfg<=2.",
        "cfg degree 4 exceeds the 2 guidance branch(es) of a step. Fix: cfg<=2.",
        "world size 12 (= dp 1 x cfg 4 x sp 3 x tp 1) exceeds the 8 cuda device(s) available. Fix: lower the "
        "degrees.",
    ]
    ok = plan_problems(
        ParallelPlan.parse("sp=4,cfg=2"), card_axes=WAN_AXES, heads=12, branches=2, devices=8, device="cuda"
    )
    assert ok == []


def test_a_deploy_entry_plan_is_checked_when_the_file_is_read():
    entry = {"card": "wan2.1-t2v-tiny", "parallel": "sp=2, cfg=2"}
    assert parse_deploy({"models": [entry]}).models[0].parallel == "sp=2,cfg=2"
    with pytest.raises(ConfigError, match="models.0.parallel.*'sp=x' is not AXIS=DEGREE"):
        parse_deploy({"models": [{**entry, "parallel": "sp=x"}]})
