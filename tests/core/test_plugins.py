import argparse
import subprocess
import sys

import pytest

from fv_core import ConfigError, DuplicateKeyError
from fv_core.deploy import DeploymentCard, check_deploy
from fv_core.extend import hookimpl
from fv_core.plugins import PluginHost, load_plugins
from tests.core.conftest import make_card


class CardPlugin:
    def __init__(self, *ids):
        self.ids = ids

    @hookimpl
    def fv_register_cards(self, register):
        for i in self.ids:
            register(make_card(i))


class EverythingPlugin:
    @hookimpl
    def fv_register_cards(self, register):
        register("lazy-card", lambda: make_card("lazy-card"))

    @hookimpl
    def fv_register_kernels(self, register):
        register(("attention", "cpu", "any", "naive"), "torch.nn.functional:scaled_dot_product_attention")

    @hookimpl
    def fv_register_interceptors(self, register):
        register("fbcache", "collections:OrderedDict")

    @hookimpl
    def fv_register_methods(self, register):
        register("finetune", "collections:OrderedDict")

    @hookimpl
    def fv_register_options(self, register):
        from pydantic import BaseModel

        register("everything", BaseModel)

    @hookimpl
    def fv_register_commands(self, register):
        def add_hello(subparsers):
            subparsers.add_parser("hello").set_defaults(func=lambda args: 0)

        register("hello", add_hello)

    @hookimpl
    def fv_register_fleets(self, register):
        register("local", lambda deploy_file, **options: 0)


class BrokenRegistration:
    @hookimpl
    def fv_register_cards(self, register):
        register(make_card("half-registered"))
        raise RuntimeError("weights index corrupt")


class UnhashableKernelKey:
    @hookimpl
    def fv_register_cards(self, register):
        register(make_card("registered-before-the-bad-key"))

    @hookimpl
    def fv_register_kernels(self, register):
        register({"op": "attention"}, "x:y")  # a dict cannot be a registry key


class MisspeltHook:
    @hookimpl
    def fv_register_card(self, register):  # missing "s": must fail loudly
        register(make_card("never"))


def test_every_hook_fills_its_registry(host: PluginHost):
    host.add(EverythingPlugin(), "everything")
    host.collect()
    regs = host.registries
    assert host.card("lazy-card").model_id == "lazy-card"
    assert ("attention", "cpu", "any", "naive") in regs.kernels
    assert "fbcache" in regs.interceptors and "finetune" in regs.methods
    assert "everything" in regs.options
    cli = argparse.ArgumentParser()
    regs.commands.get("hello")(cli.add_subparsers())
    assert cli.parse_args(["hello"]).func(None) == 0
    assert host.fleet("local")("deploy.yaml", host="127.0.0.1", port=1, data_dir=None, api_key=None,
                               device="cpu", address=None) == 0  # fmt: skip
    (info,) = [p for p in host.report() if p["name"] == "everything"]
    assert len(info["hooks"]) == 7
    assert info["registered"]["cards"] == ["lazy-card"]


def test_broken_registration_is_isolated_and_rolled_back(host: PluginHost):
    host.add(CardPlugin("good"), "good")
    host.add(BrokenRegistration(), "broken")
    host.collect()
    assert "good" in host.registries.cards
    assert "half-registered" not in host.registries.cards
    (err,) = host.errors
    assert err.plugin == "broken" and err.stage == "register" and "weights index corrupt" in err.error


def test_bad_key_rolls_back_everything_the_plugin_registered(host: PluginHost):
    host.add(UnhashableKernelKey(), "bad-key")
    host.collect()
    assert "registered-before-the-bad-key" not in host.registries.cards
    (err,) = host.errors
    assert err.plugin == "bad-key" and "unhashable" in err.error


def test_a_card_two_plugins_register_is_refused_until_the_deploy_chooses(host: PluginHost):
    host.add(CardPlugin("wan", "wan-extra"), "first")
    host.add(CardPlugin("wan", "other"), "squatter")
    host.collect()
    assert not host.errors and {"wan-extra", "other"} <= set(host.registries.cards)  # both plugins load
    with pytest.raises(
        DuplicateKeyError,
        match=r"'wan' is registered by plugins \['first', 'squatter'\].*"
        r"not pick one by install order.*'plugins' list",
    ):
        host.card("wan")  # neither wins silently, whichever installed first
    report = {p["name"]: p for p in host.report()}
    assert report["squatter"]["contested"] == {"cards": {"wan": ["first", "squatter"]}}

    deploy = DeploymentCard(plugins=["squatter"], models=[{"card": "wan"}], limits=None)
    assert check_deploy(deploy, host) == []  # enabling one plugin chooses its card
    assert host.registries.cards.plugin_of("wan") == "squatter"


def test_a_plugin_whose_registration_fails_gives_back_its_contested_keys(host: PluginHost):
    host.registries.cards.register("wan", "x:first", "first")
    host.registries.cards.register("wan", "x:second", "second")
    host.registries.cards.unregister("wan", "second")
    assert host.registries.cards.entries["wan"].plugin == "first" and not host.registries.cards.contested


def test_misspelt_hook_fails_loudly(host: PluginHost):
    host.add(MisspeltHook(), "typo")
    (err,) = host.errors
    assert "fv_register_card" in err.error


def test_required_plugin_reports_its_load_error(host: PluginHost):
    host.add(BrokenRegistration(), "broken")
    host.collect()
    with pytest.raises(ConfigError, match="'broken' is required but failed to load: RuntimeError"):
        host.require(["broken"])
    with pytest.raises(ConfigError, match="'fv-missing' is required but not installed"):
        host.require(["fv-missing"])


def test_entry_points_discover_installed_plugin_and_isolate_broken(on_path):
    host = load_plugins(env={})
    info = {p["name"]: p for p in host.report()}
    assert info["fv-example"]["distribution"] == "fv-example" and info["fv-example"]["version"] == "0.3.1"
    assert info["fv-example"]["registered"] == {
        "cards": ["shapes-euler-8"],
        "kernels": ["('attention', 'cpu', 'any', 'naive')"],
        "interceptors": ["step-counter"],
        "options": ["fv-example"],
    }
    assert "boom: missing CUDA toolkit" in info["fv-broken"]["error"]
    assert [e.stage for e in host.errors if e.plugin == "fv-broken"] == ["import"]
    card = host.card("shapes-euler-8")  # a variant of fv-wan's card, assembled on it
    assert card.parent == "wan2.1-t2v-shapes" and card.kernels == {"attention": "sdpa"}
    assert card.programs["t2v"].defaults["num_inference_steps"] == 8


def test_allowlist_and_blocklist(on_path):
    only = load_plugins(env={"FV_PLUGINS": "fv-example"})
    assert "fv-example" in only.infos and "fv-broken" not in only.infos
    blocked = load_plugins(env={"FV_DISABLE_PLUGINS": "fv-broken, fv-example"})
    assert "fv-example" not in blocked.infos and "fv-broken" not in blocked.infos
    assert not blocked.errors


def test_trace_prints_hook_calls(on_path):
    code = "from fv_core.plugins import load_plugins; load_plugins()"
    env = {"FV_TRACE_PLUGINS": "1", "FV_PLUGINS": "fv-example", "PYTHONPATH": f"{on_path}:{sys.path[0]}"}
    import os

    out = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True
    )
    assert "[fv-trace] fv-example.fv_register_cards registered ['shapes-euler-8']" in out.stderr
