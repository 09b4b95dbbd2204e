"""The example third-party plugin, installed the way a user installs it, does all it registers.

``tests/fixtures/fv-example-plugin`` (CONTRIBUTING.md builds it step by step) adds a card variant
of fv-wan's shapes card, a CPU attention kernel, an observer and its options. Here it is built
into a wheel with fv-core and fv-wan, installed into a fresh venv, and run there.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess

import pytest
import torch
import torch.nn.functional as F

from fv_core.kernels import check_kernel
from tests.core.conftest import EXAMPLE_PLUGIN, REPO
from tests.core.fresh_venv import build_wheels, clean_env, fresh_venv

PROMPT = "a red circle moving left"

# Runs inside the fresh venv; prints one JSON line last.
SCRIPT = """
import json, sys
from pathlib import Path

import numpy as np

import fv_core, fv_example, fv_wan

prompt = sys.argv[1]
out = {"files": {m.__name__: m.__file__ for m in (fv_core, fv_wan, fv_example)}}

variant = fv_core.load("shapes-euler-8").generate(prompt=prompt)
out["variant"] = {k: variant.provenance[k] for k in ("card", "parent", "params")}
parent = fv_core.load("wan2.1-t2v-shapes").generate(**variant.provenance["params"])
out["parent"] = {k: parent.provenance[k] for k in ("card", "parent", "params")}
out["frames_equal"] = bool(np.array_equal(variant.frames, parent.frames))

deploy = Path(sys.argv[2])
deploy.write_text(
    "plugins: [fv-wan, fv-example]\\n"
    "models:\\n"
    "  - card: shapes-euler-8\\n"
    "    kernels: {attention: naive}\\n"
    "    interceptors: [step-counter]\\n"
    "plugin_options:\\n"
    "  fv-example: {label: hi}\\n"
)
served = fv_core.load("shapes-euler-8", deploy=deploy)
small = dict(prompt=prompt, num_frames=5, height=32, width=32)
keys = ("card", "kernels", "interceptors", "plugin_options", "metrics")
first = served.generate(**small)
again = served.generate(**small, plugin_options={"fv-example": {"label": "asked"}})
out["deployed"] = [{k: a.provenance[k] for k in keys} for a in (first, again)]
out["attn1_kernel"] = served.instance.component("transformer").blocks[0].attn1.processor.kernel.__qualname__
print(json.dumps(out, default=str))
"""


@pytest.fixture(scope="module")
def run_in_fresh_venv(tmp_path_factory):
    """fv-core, fv-wan and fv-example wheels in a fresh venv; runs SCRIPT there, returns its JSON."""
    tmp = tmp_path_factory.mktemp("example")
    example = tmp / "fv-example-plugin"  # a clean copy: no stale build/ of an older layout
    shutil.copytree(EXAMPLE_PLUGIN, example, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    wheels = build_wheels([REPO, REPO / "plugins" / "fv-wan", example], tmp / "wheels")
    assert [w.name.split("-")[0] for w in wheels] == ["fv_core", "fv_example", "fv_wan"]
    env = clean_env(FV_CACHE_DIR=str(tmp / "cache"), FV_PLUGINS="fv-wan,fv-example")
    fresh = fresh_venv(tmp / "venv", wheels, env)
    (tmp / "run").mkdir()
    script = tmp / "run" / "script.py"
    script.write_text(SCRIPT)
    proc = subprocess.run(
        [str(fresh.python), str(script), PROMPT, str(tmp / "run" / "deploy.yaml")],
        cwd=tmp / "run",
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return fresh, json.loads(proc.stdout.strip().splitlines()[-1])


def test_installed_from_wheels_not_the_checkout(run_in_fresh_venv):
    fresh, out = run_in_fresh_venv
    for module, path in out["files"].items():
        assert path.startswith(str(fresh.site)), (module, path)


def test_card_variant_defaults_and_parity_with_its_parent(run_in_fresh_venv):
    _, out = run_in_fresh_venv
    variant, parent = out["variant"], out["parent"]
    assert variant["card"] == "shapes-euler-8" and variant["parent"] == "wan2.1-t2v-shapes"
    params = variant["params"]
    assert params["prompt"] == PROMPT
    assert params["num_inference_steps"] == 8 and params["sampler"] == "euler"
    # The parent asked with the same params in full (its own defaults: 30 UniPC steps) ...
    assert parent["card"] == "wan2.1-t2v-shapes" and parent["parent"] is None
    assert parent["params"] == params
    # ... makes the same frames, bit for bit: a variant changes defaults, nothing else.
    assert out["frames_equal"]


def test_deploy_applies_kernel_observer_and_options(run_in_fresh_venv):
    _, out = run_in_fresh_venv
    first, again = out["deployed"]
    for prov in (first, again):
        assert prov["card"] == "shapes-euler-8"
        kernel = prov["kernels"]["attention"]
        assert kernel["variant"] == "naive" and kernel["plugin"] == "fv-example" and kernel["device"] == "cpu"
        assert prov["interceptors"] == ["step-counter"]
        assert prov["metrics"]["steps"] == 8 and prov["metrics"]["cfg"] == "off"  # guidance 1: one forward
    # WanLoop's runner steps: encode prompt + text keys/values (both skipped on a cache hit),
    # one per denoise step, one VAE decode.
    assert first["metrics"]["text_cache_hits"] == 0 and first["metrics"]["kv_cache_hits"] == 0
    assert first["metrics"]["step_counter"] == {"steps_seen": 1 + 1 + 8 + 1, "label": "hi"}
    assert first["plugin_options"] == {"fv-example": {"label": "hi"}}
    # The second request hits both prompt caches; its count starts afresh (per-request state),
    # and its own options override the deploy's.
    assert again["metrics"]["text_cache_hits"] == 1 and again["metrics"]["kv_cache_hits"] == 1
    assert again["metrics"]["step_counter"] == {"steps_seen": 8 + 1, "label": "asked"}
    assert again["plugin_options"] == {"fv-example": {"label": "asked"}}
    assert out["attn1_kernel"] == "naive_attention"  # what every block's self-attention ran


@pytest.mark.parametrize("case", ["plain", "scale", "causal", "bool_mask", "float_mask", "causal_and_mask"])
def test_naive_attention_matches_sdpa(on_path, case):
    from fv_example.kernels import naive_attention

    check_kernel(("attention", "cpu", "any", "naive"), naive_attention)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 6, 8, generator=gen) for _ in range(3))
    kw: dict = {}
    if case == "scale":
        kw["scale"] = 0.3
    if case in ("causal", "causal_and_mask"):
        kw["is_causal"] = True
    if case in ("bool_mask", "causal_and_mask"):
        kw["attn_mask"] = torch.rand(6, 6, generator=gen) > 0.3
        kw["attn_mask"].fill_diagonal_(True)  # every query attends somewhere
    if case == "float_mask":
        kw["attn_mask"] = torch.randn(2, 1, 6, 6, generator=gen)
    got = naive_attention(q, k, v, **kw)
    if case == "causal_and_mask":  # SDPA takes one or the other: give it both as one mask
        mask = kw.pop("attn_mask") & torch.ones(6, 6, dtype=torch.bool).tril()
        kw = {"attn_mask": mask}
    want = F.scaled_dot_product_attention(q, k, v, **kw)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not math.isnan(got.sum().item())
