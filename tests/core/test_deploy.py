import json

import pytest

from fv_core import ConfigError
from fv_core.deploy import check_deploy, load_deploy, parse_deploy, validate_plugin_options
from fv_core.plugins import load_plugins

CARD = "shapes-euler-8"  # the example plugin's variant of fv-wan's shapes card
GOOD = {
    "plugins": ["fv-wan", "fv-example"],
    "models": [{"card": CARD, "kernels": {"attention": "naive"}, "interceptors": ["step-counter"]}],
    "limits": {"max_frames": 33, "max_queue": 4},
    "plugin_options": {"fv-example": {"label": "two"}},
}


@pytest.fixture
def example_host(on_path):
    return load_plugins(env={"FV_PLUGINS": "fv-wan,fv-example,fv-broken"})


def with_changes(**changes):
    data = json.loads(json.dumps(GOOD))
    for key, value in changes.items():
        data[key] = value
    return parse_deploy(data)


def test_good_deploy_has_no_problems(example_host):
    assert check_deploy(parse_deploy(GOOD), example_host) == []


def test_yaml_and_json_files(tmp_path):
    (tmp_path / "d.yaml").write_text(f"plugins: [fv-example]\nmodels:\n  - card: {CARD}\n")
    assert load_deploy(tmp_path / "d.yaml").models[0].served_name == CARD
    (tmp_path / "d.json").write_text(json.dumps(GOOD))
    assert load_deploy(tmp_path / "d.json").limits.max_queue == 4
    (tmp_path / "bad.yaml").write_text("models: [card: x\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_deploy(tmp_path / "bad.yaml")
    with pytest.raises(ConfigError, match="does not exist"):
        load_deploy(tmp_path / "missing.yaml")


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"models": [{"card": "x", "weigths": "/w"}]}, r"models.0.weigths: .*unknown field"),
        ({"models": []}, r"models: List should have at least 1 item"),
        (
            {"models": [{"card": "x"}], "limits": {"max_frames": 0}},
            r"limits.max_frames: .*greater than or equal to 1",
        ),
        ({"models": [{"card": "x"}], "server": {}}, r"server: .*unknown field"),
    ],
)
def test_schema_errors_name_field_value_and_fix(data, message):
    with pytest.raises(ConfigError, match=message):
        parse_deploy(data)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"plugins": ["fv-wan", "fv-example", "fv-broken"]},
            "'fv-broken' is required but failed to load: RuntimeError: boom",
        ),
        ({"plugins": ["fv-wan", "fv-example", "fv-nope"]}, "'fv-nope' is required but not installed"),
        (
            {"plugins": ["fv-wan"], "plugin_options": {}},
            "from plugin 'fv-example', which this deploy does not enable",
        ),
        ({"models": [{"card": "wan-huge"}]}, "unknown cards key 'wan-huge'. Available: .*'shapes-euler-8'"),
        (
            {"models": [{"card": CARD, "kernels": {"attention": "flash9"}}]},
            r"models\[0\]\.kernels\.attention: no loaded plugin registers the kernel 'flash9' \(available: "
            r"\[.*\]\)\. Fix: use one of those, or install the plugin that provides it",
        ),
        (
            {"models": [{"card": CARD, "interceptors": ["teacache"]}]},
            r"models\[0\]\.interceptors: no loaded plugin registers the interceptor 'teacache'",
        ),
        ({"models": [{"card": CARD}, {"card": CARD}]}, "served names"),
        (
            {"plugin_options": {"fv-example": {"labl": 2}}},
            "labl: Extra inputs are not permitted.*unknown field.*Allowed: \\['label'\\]",
        ),
        (
            {"plugin_options": {"fv-cache-dit": {"threshold": 1}}},
            "options name 'fv-cache-dit', which this deployment does not enable",
        ),
        (
            {"models": [{"card": CARD, "adapters": {"style": "/nowhere/style.safetensors"}}]},
            r"models\[0\]\.adapters\.style: '/nowhere/style.safetensors' does not exist\. Fix: give a LoRA",
        ),
        (
            {"models": [{"card": CARD, "adapters": {"style": {"path": __file__, "scale": 0.5}}}]},
            None,  # an existing file passes validate (load reads and checks its modules)
        ),
    ],
)
def test_deploy_problems(example_host, changes, message):
    import re

    problems = check_deploy(with_changes(**changes), example_host)
    if message is None:
        assert problems == []
    else:
        assert any(re.search(message, p) for p in problems), problems


def test_card_rejecting_an_interceptor_kind(example_host):
    from fv_core.card import CapabilityMatrix
    from fv_core.extend import hookimpl
    from tests.core.conftest import make_card

    class SkipEveryOther:
        kind = "step_skip"

    class Distilled:
        @hookimpl
        def fv_register_cards(self, register):
            register(make_card("distilled-3step", capabilities=CapabilityMatrix()))

        @hookimpl
        def fv_register_interceptors(self, register):
            register("skip-every-other", SkipEveryOther)

    example_host.add(Distilled(), "distilled")
    example_host.collect()
    deploy = with_changes(
        plugins=["fv-wan", "fv-example", "distilled"],
        models=[{"card": "distilled-3step", "interceptors": ["skip-every-other", "step-counter"]}],
    )
    (problem,) = check_deploy(deploy, example_host)  # observers are accepted everywhere
    assert (
        "card 'distilled-3step' rejects 'skip-every-other' (a step_skip interceptor: it skips whole denoise "
        "steps); it accepts none" in problem
    )


def test_request_may_only_parameterize_enabled_plugins(example_host):
    deploy = parse_deploy(GOOD)
    assert validate_plugin_options(example_host, deploy, "fv-example", {"label": "x"}).label == "x"
    with pytest.raises(ConfigError, match="does not enable"):
        validate_plugin_options(example_host, deploy, "fv-sta", {"window": [3, 3, 3]})
    with pytest.raises(ConfigError, match="label: Input should be a valid string"):
        validate_plugin_options(example_host, deploy, "fv-example", {"label": 3})
