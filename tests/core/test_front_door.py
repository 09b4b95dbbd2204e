"""The core front door without a model family: errors explained once, kernels checked when they
register, card variants, plugin options merged once, folders read by a registered pipeline reader."""

from __future__ import annotations

import json
import types

import pytest
from pydantic import BaseModel, ConfigDict, Field, ValidationError

import fv_core
from fv_core import CardValidationError, ConfigError
from fv_core.card import CardVariant, LoopSpec, ProgramSpec, RecipeSpec
from fv_core.card.assemble import assemble_card
from fv_core.errors import explain
from fv_core.extend import hookimpl
from fv_core.kernels_select import select_kernel
from fv_core.loop import LoopKind, WorkUnitKind
from fv_core.model import OptionsPolicy
from tests.core.conftest import make_card


class Knobs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    level: int = 1
    name: str = "a"


def test_explain_names_each_field_rule_value_and_fix():
    with pytest.raises(ValidationError) as info:
        Knobs.model_validate({"level": "x", "nmae": 2})
    text = explain(info.value, "options for plugin 'p'", Knobs.model_fields)
    assert text.startswith("options for plugin 'p': ")
    assert "level: Input should be a valid integer" in text and "got 'x'" in text
    assert (
        "nmae: Extra inputs are not permitted; got 2. Fix: it is an unknown field; remove it or check its spelling. Allowed: ['level', 'name']"
        in text
    )


def good_kernel(query, key, value, attn_mask=None, is_causal=False, scale=None):
    return query


def bad_kernel(q, k, v):
    return q


def test_kernels_are_checked_against_their_ops_signature_when_they_register(host):
    plugin = types.SimpleNamespace(
        fv_register_kernels=hookimpl(
            lambda register: register(("attention", "cpu", "any", "bad"), bad_kernel)
        )
    )
    host.add(plugin, "fv-bad")
    host.collect()
    (error,) = host.errors
    assert (
        error.plugin == "fv-bad"
        and "must take (query, key, value, attn_mask, is_causal, scale)" in error.error
    )
    lazy = types.SimpleNamespace(
        fv_register_kernels=hookimpl(
            lambda register: register(
                ("attention", "cpu", "any", "lazy"), "tests.core.test_front_door:bad_kernel"
            )
        )
    )
    host.add(lazy, "fv-lazy")
    host.collect()
    with pytest.raises(ConfigError, match="takes \\(q, k, v\\)"):  # checked when first imported
        select_kernel(host.registries, "attention", "lazy", "cpu")
    ok = types.SimpleNamespace(
        fv_register_kernels=hookimpl(
            lambda register: register(("attention", "cpu", "any", "ok"), good_kernel)
        )
    )
    host.add(ok, "fv-ok")
    host.collect()
    assert select_kernel(host.registries, "attention", "ok", "cpu")[0] is good_kernel


def cards_plugin(*cards):
    return types.SimpleNamespace(fv_register_cards=hookimpl(lambda register: [register(c) for c in cards]))


def test_a_card_variant_takes_its_own_id_and_defaults_and_keeps_the_rest(host):
    parent = make_card("toy", programs={"t2v": ProgramSpec(stages=["denoise"], defaults={"seed": 1})})
    variant = CardVariant(model_id="toy-7", parent="toy", description="seed 7", defaults={"t2v": {"seed": 7}})
    host.add(cards_plugin(parent, variant), "fv-toy")
    host.collect()
    card = assemble_card(host.registries, "toy-7")
    assert card.model_id == "toy-7" and card.parent == "toy" and card.description == "seed 7"
    assert card.programs["t2v"].defaults == {"seed": 7} and card.components == parent.components
    assert assemble_card(host.registries, "toy").programs["t2v"].defaults == {"seed": 1}


@pytest.mark.parametrize(
    ("defaults", "match"),
    [
        ({"i2v": {"seed": 1}}, "defaults.i2v: 'toy' has no task 'i2v'"),
        ({"t2v": {"steps": 8}}, "programs.t2v.defaults: \\['steps'\\] are not request params"),
    ],
)
def test_variant_defaults_are_checked(host, defaults, match):
    host.add(
        cards_plugin(make_card("toy"), CardVariant(model_id="v", parent="toy", defaults=defaults)), "fv-toy"
    )
    host.collect()
    with pytest.raises(CardValidationError, match=match):
        assemble_card(host.registries, "v")


def test_plugin_options_merge_the_deploys_with_the_requests_once():
    policy = OptionsPolicy(
        schemas={"p": Knobs, "k": Knobs},
        enabled=frozenset({"p", "k"}),
        base={"p": {"level": 3}},
        per_request=frozenset({"p"}),  # "k" provides kernels only: its options are bound at load
    )
    merged = policy.merge({"p": {"name": "b"}})["p"]
    assert isinstance(merged, Knobs) and (merged.level, merged.name) == (3, "b")
    assert merged.model_fields_set == {"level", "name"}  # what provenance records
    with pytest.raises(ConfigError, match="plugin 'k' has no interceptor.*set them in the deploy"):
        policy.merge({"k": {"level": 2}})
    assert policy.merge(None)["p"].level == 3
    with pytest.raises(ConfigError, match="'q', which this deployment does not enable") as info:
        policy.merge({"q": {}})
    assert info.value.param == "plugin_options"
    with pytest.raises(ConfigError, match="options for plugin 'p': level: .*got 'x'"):
        policy.merge({"p": {"level": "x"}})


class ToyInstance:
    """What a toy family's instance factory returns: enough for load to bind it."""

    def __init__(self, card, folder, device, kernels=None):
        self.card, self.folder, self.kernels = card, folder, kernels


class ToyFolder:
    """A pipeline reader: a card from the folder's own config."""

    @staticmethod
    def card(folder):
        depth = json.loads((folder / "dit" / "config.json").read_text())["depth"]
        return make_card(
            f"toy:{folder.name}", description=f"{depth} blocks", instance_factory=f"{__name__}:ToyInstance"
        )

    @staticmethod
    def bind(card, folder):
        return card


@hookimpl
def fv_register_pipelines(register):
    register("ToyPipeline", ToyFolder)


def test_load_reads_a_folder_through_the_registered_pipeline_reader(host, tmp_path):
    host.add(types.SimpleNamespace(fv_register_pipelines=fv_register_pipelines), "fv-toy")
    host.collect()
    folder = tmp_path / "toy-folder"
    (folder / "dit").mkdir(parents=True)
    (folder / "dit" / "config.json").write_text(json.dumps({"depth": 3}))
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "ToyPipeline"}))
    model = fv_core.load(str(folder), host=host)
    assert model.card.model_id == "toy:toy-folder" and model.card.description == "3 blocks"
    assert model.plugin == "fv-toy" and model.kernels["attention"]["variant"] == "sdpa"
    assert model.instance.kernels["attention"][0] is not None and model.prepare({"seed": 4}).params.seed == 4
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "OtherPipeline"}))
    with pytest.raises(
        fv_core.WeightsError, match="'OtherPipeline' checkpoint.*readable: \\['ToyPipeline'\\]"
    ):
        fv_core.load(str(folder), host=host)
    with pytest.raises(
        fv_core.UnknownKeyError, match="neither a registered card nor a diffusers-format folder"
    ):
        fv_core.load(str(tmp_path / "nowhere"), host=host)


class CountParams(fv_core.request.Params):
    steps: int = Field(ge=1, le=10, description="steps per stage")


class CountLoop:
    """A loop of ``steps`` steps that counts them (a real WorkPlan body per step)."""

    def __init__(self, instance):
        self.instance = instance

    def init(self, request, instance, ctx):
        return fv_core.loop.LoopState(request.request_id, "count", total_steps=request.params.steps)

    def next(self, state):
        if state.step == state.total_steps:
            return fv_core.loop.Done()
        return fv_core.loop.WorkPlan(fv_core.loop.WorkUnitKind.AR_TOKEN, lambda inputs: {"one": 1}, {})

    def advance(self, state, result):
        state.step += result.outputs["one"]
        return state

    def finalize(self, state):
        return fv_core.loop.LoopResult({"text": f"counted {state.step}"})


def test_a_task_of_two_loops_runs_as_a_program(host, tmp_path):
    loop = LoopSpec(
        kind=LoopKind.AR_DECODE,
        work_unit_kind=WorkUnitKind.AR_TOKEN,
        loop_factory=f"{__name__}:CountLoop",
        params=f"{__name__}:CountParams",
    )
    card = make_card(
        "counter",
        loops={"count": loop},
        recipe=RecipeSpec(assumes_loop="count"),
        caches={},
        programs={"twice": ProgramSpec(stages=["count", "count"], defaults={"steps": 2}, outputs=["text"])},
        components={},
        instance_factory=f"{__name__}:ToyInstance",
    )
    host.add(cards_plugin(card), "fv-counter")
    host.collect()
    model = fv_core.load("counter", tmp_path, host=host)
    text = model.generate(steps=3)
    assert isinstance(text, fv_core.TextArtifact) and text.text == "counted 3"
    metrics = text.provenance["metrics"]
    assert metrics["steps"] == 6 and list(metrics["stages"]) == ["0:count", "1:count"]
    assert model.generate().provenance["params"] == {"seed": 0, "steps": 2}  # the card's default


def test_a_lazy_registration_that_cannot_be_imported_is_reported_not_raised(host):
    from fv_core.deploy import check_deploy, parse_deploy

    broken = types.SimpleNamespace(
        fv_register_cards=hookimpl(lambda register: register("ghost", "fv_nowhere.cards:ghost"))
    )
    host.add(broken, "fv-ghost")
    host.collect()
    (report,) = [p for p in host.report() if p["name"] == "fv-ghost"]
    assert "'fv_nowhere.cards:ghost', which cannot be imported (ModuleNotFoundError" in report["error"]
    problems = check_deploy(parse_deploy({"plugins": ["fv-ghost"], "models": [{"card": "ghost"}]}), host)
    assert problems and all("fv-ghost" in p for p in problems)  # a message, not a crash
