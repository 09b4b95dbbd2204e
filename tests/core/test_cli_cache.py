"""``fv generate --cache NAME[:THRESHOLD]`` and ``--attention VARIANT``: the interceptor runs (provenance
shows it), bad values are clear errors, and a variant or interceptor no loaded plugin registers names the
plugin that provides it and its pip command."""

from __future__ import annotations

import json

import pytest

from fv_core.cli import main

TINY = "wan2.1-t2v-tiny"
SMALL = ["--size", "32x32", "--num-frames", "5", "--steps", "10", "--seed", "1"]


@pytest.fixture(autouse=True)
def _dirs(tmp_path, monkeypatch):
    monkeypatch.setenv("FV_CACHE_DIR", str(tmp_path / "cache"))


def test_cache_flag_enables_the_interceptor_with_its_threshold(tmp_path):
    out = tmp_path / "cat.mp4"
    argv = ["generate", "--model", TINY, "--prompt", "a cat", *SMALL, "--cache", "fbcache:1", "-o", str(out)]
    assert main(argv) == 0
    prov = json.loads(out.with_suffix(".json").read_text())
    assert prov["interceptors"] == ["fbcache"]
    assert prov["plugin_options"]["fv-cache-dit"]["residual_diff_threshold"] == 1
    assert prov["metrics"]["cache_dit"]["cached"] > 0  # threshold 1: every step past the 8 warmup steps


def test_a_threshold_that_is_not_a_number_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--model", TINY, "--prompt", "a", "--cache", "fbcache:fast"])
    says = (
        "'fbcache:fast': the threshold 'fast' is not a number; the form is NAME[:THRESHOLD], e.g. fbcache:0.1"
    )
    assert says in capsys.readouterr().err


def test_an_unknown_cache_lists_the_interceptors(capsys):
    assert main(["generate", "--model", TINY, "--prompt", "a", "--cache", "nocache"]) == 2
    err = capsys.readouterr().err
    assert "--cache nocache: no loaded plugin registers the interceptor 'nocache'" in err
    assert "'fbcache'" in err and "Fix: use one of those" in err


def test_unknown_variant_and_interceptor_name_the_plugin_and_the_pip_command(monkeypatch, capsys):
    monkeypatch.setenv("FV_DISABLE_PLUGINS", "fv-sta,fv-cache-dit")
    assert main(["generate", "--model", TINY, "--prompt", "a", "--attention", "sta"]) == 2
    err = capsys.readouterr().err
    assert "--attention sta: no loaded plugin registers the kernel 'sta'" in err
    assert "'sta' is provided by fv-sta, which is not loaded. Fix: pip install -e plugins/fv-sta" in err
    assert main(["generate", "--model", TINY, "--prompt", "a", "--cache", "taylorseer"]) == 2
    err = capsys.readouterr().err
    assert (
        "'taylorseer' is provided by fv-cache-dit, which is not loaded. Fix: pip install -e plugins/fv-cache-dit"
        in err
    )
