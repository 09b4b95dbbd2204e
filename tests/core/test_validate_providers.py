"""`fv validate` of a deploy file whose kernel variant or interceptor no loaded plugin registers: the
problem names the plugin that provides it and the pip command, not a list of what is registered alone."""

from __future__ import annotations

import pytest

from fv_core.cli import main


@pytest.mark.parametrize(
    ("deploy", "disabled", "says"),
    [
        (
            "examples/deploy/sta.yaml",
            "fv-sta",
            "models[0].kernels.attention: no loaded plugin registers the kernel 'sta' (available: ['sdpa']). "
            "'sta' is provided by fv-sta, which is not loaded. Fix: pip install -e plugins/fv-sta",
        ),
        (
            "examples/deploy/fbcache.yaml",
            "fv-cache-dit",
            "models[0].interceptors: no loaded plugin registers the interceptor 'fbcache' (available: "
            "['inferix']). 'fbcache' is provided by fv-cache-dit, which is not loaded. Fix: pip install -e "
            "plugins/fv-cache-dit",
        ),
    ],
)
def test_a_missing_provider_is_named_with_its_pip_command(deploy, disabled, says, monkeypatch, capsys):
    monkeypatch.setenv("FV_DISABLE_PLUGINS", disabled)
    assert main(["validate", deploy]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert says in err
    assert f"plugin {disabled!r} is required but not installed" in err  # the deploy's own plugin list
    assert "takes no options" not in err  # its options are not blamed on a plugin that is absent


def test_the_example_validates_with_its_plugins(capsys):
    assert main(["validate", "examples/deploy/sta.yaml"]) == 0
    assert capsys.readouterr().out.startswith("ok: examples/deploy/sta.yaml")
