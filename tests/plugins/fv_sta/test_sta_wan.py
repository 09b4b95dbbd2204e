"""STA as the Wan transformer's self-attention: selected per model, run end to end, named in provenance."""

from __future__ import annotations

import pytest
import torch

import fv_core
import fv_sta.plugin
import fv_wan.plugin
from fv_core import ConfigError, UnknownKeyError
from fv_core.deploy.card import parse_deploy
from fv_core.load import resolve_kernels
from fv_core.plugins import PluginHost
from fv_core.serving.jobs import JobStore
from fv_core.serving.metrics import Metrics
from fv_core.serving.service import Service
from fv_wan.model import WanModel
from fv_wan.tiny import tiny_weights
from fv_wan.transformer import wan_forward

TINY = "wan2.1-t2v-tiny"
TILE = (1, 2, 2)  # small tiles so the tiny latent grids hold several


@pytest.fixture(scope="module")
def host() -> PluginHost:
    host = PluginHost(env={})
    host.add(fv_wan.plugin, "fv-wan")
    host.add(fv_sta.plugin, "fv-sta")
    return host.collect()


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> str:
    return tiny_weights(tmp_path_factory.mktemp("wan") / TINY)


def load(host, weights, variant="sdpa", window=(1, 1, 1)):
    """The tiny card with attention ``variant`` (STA with ``window``), as a deploy file selects it."""
    deploy = parse_deploy(
        {
            "plugins": ["fv-wan", "fv-sta"],
            "models": [{"card": TINY, "weights": weights, "kernels": {"attention": variant}}],
            "plugin_options": {"fv-sta": {"windows": [{"tile": list(TILE), "window": list(window)}]}},
        }
    )
    return fv_core.load(TINY, deploy=deploy, host=host)


def velocity(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, text = torch.randn(1, 16, 3, 8, 8, generator=g), torch.randn(1, 8, 32, generator=g)
    with torch.no_grad():
        return wan_forward(model.instance.component("transformer"), x, torch.tensor([700]), text)


def test_wan_generation_with_sta_runs_end_to_end_and_names_the_kernel(host, weights):
    params = {"prompt": "a dog", "negative_prompt": "blurry", "num_inference_steps": 2, "seed": 3}
    video = load(host, weights, "sta").generate(**params)
    assert video.frames.shape == (5, 32, 32, 3) and torch.isfinite(torch.from_numpy(video.frames)).all()
    attention = video.provenance["kernels"]["attention"]
    assert attention["variant"] == "sta" and attention["plugin"] == "fv-sta"
    assert attention["key"] == ["attention", "cpu", "any", "sta"] and attention["fallback_reason"] is None
    call = attention["call"]  # 5 frames of 32x32 -> latents 2x4x4 -> tokens 2x2x2
    assert call["path"] == "gather" and call["grid"] == (2, 2, 2)
    assert call["tile"] == TILE and call["window"] == (1, 1, 1)
    dense = load(host, weights).generate(**params)
    assert dense.provenance["kernels"]["attention"]["variant"] == "sdpa"
    assert (dense.frames != video.frames).any()  # each frame attended only to itself


def test_sta_over_the_whole_grid_is_the_dense_forward(host, weights):
    dense = velocity(load(host, weights))
    whole = velocity(load(host, weights, "sta", window=(3, 2, 2)))  # grid (3, 4, 4) is 3x2x2 tiles
    local = velocity(load(host, weights, "sta", window=(1, 1, 1)))
    assert (whole - dense).abs().max() <= 1e-5
    assert (local - dense).abs().max() > 1e-3


def test_selected_sdpa_is_bit_identical_to_diffusers_attention(host, weights):
    """The registry's SDPA through fv's processor computes what diffusers' WanAttnProcessor does."""
    plain = WanModel(host.card(TINY), weights)  # no kernels resolved: diffusers' own processor
    transformer = plain.component("transformer")
    g = torch.Generator().manual_seed(0)
    x, text = torch.randn(1, 16, 3, 8, 8, generator=g), torch.randn(1, 8, 32, generator=g)
    with torch.no_grad():
        ref = wan_forward(transformer, x, torch.tensor([700]), text)
    assert torch.equal(velocity(load(host, weights)), ref)
    assert plain.kernel_records() == {"attention": "sdpa"}


def test_grid_kernel_without_a_grid_is_a_clear_error(host, weights):
    transformer = load(host, weights, "sta").instance.component("transformer")
    x, text = torch.randn(1, 16, 1, 4, 4), torch.randn(1, 8, 32)
    with pytest.raises(ConfigError, match="needs the latent token grid"), torch.no_grad():
        transformer(x, torch.tensor([500]), text)  # diffusers' own forward states no grid


def test_unknown_variant_is_an_error_listing_the_variants(host):
    with pytest.raises(UnknownKeyError, match="sta"):
        resolve_kernels(host, host.card(TINY), "cpu", requested={"attention": "flash9"})


def test_card_asking_for_sta_needs_resolved_kernels(host, weights):
    card = host.card(TINY).model_copy(update={"kernels": {"attention": "sta"}})
    with pytest.raises(ConfigError, match="no kernels were resolved"):
        WanModel(card, weights)


def test_deploy_selects_sta_with_its_options(host, weights, tmp_path):
    window = {"card": TINY, "tile": list(TILE), "window": [2, 1, 1]}
    deploy = parse_deploy(
        {
            "plugins": ["fv-wan", "fv-sta"],
            "models": [{"card": TINY, "weights": weights, "kernels": {"attention": "sta"}}],
            "plugin_options": {"fv-sta": {"windows": [window]}},
            "data_dir": str(tmp_path),
        }
    )
    store = JobStore(tmp_path)
    served = Service(deploy, host, store, Metrics())._load_models()[TINY]  # what the server's start loads
    store.close()
    video = served.loaded.generate(prompt="a cat", num_inference_steps=1, seed=1)
    call = video.provenance["kernels"]["attention"]["call"]
    assert call["path"] == "gather" and call["window"] == (2, 1, 1)


def test_fv_cards_shows_the_kernels_a_deploy_selects(weights, tmp_path, capsys):
    import json

    from fv_core.cli import main

    deploy = tmp_path / "deploy.json"
    models = [
        {"card": TINY, "weights": weights, "kernels": {"attention": "sta"}},
        {"card": TINY, "weights": weights, "name": "dense"},
    ]
    deploy.write_text(json.dumps({"plugins": ["fv-wan", "fv-sta"], "models": models}))
    assert main(["cards", "--deploy", str(deploy)]) == 0
    out = capsys.readouterr().out
    assert "attention: sta from fv-sta, key ('attention', 'cpu', 'any', 'sta')" in out
    assert "attention: sdpa from fv-core" in out.split("dense")[1]
    deploy.write_text(json.dumps({"plugins": ["fv-wan"], "models": models[:1]}))  # fv-sta not enabled
    assert main(["cards", "--deploy", str(deploy)]) == 2
    assert "fv-sta" in capsys.readouterr().err
