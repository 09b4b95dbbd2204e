"""LoRA adapters per request on Qwen-Image: C1 against diffusers' ``load_lora_weights`` +
``set_adapters`` on the same weights and seed (two combined, each scaled), and a request without
adapters unchanged beside them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import fv_core

# every kind of linear a Qwen-Image block has: image/text attention projections, MLPs, modulation
TARGETS = (
    "attn.to_q",
    "attn.to_v",
    "attn.add_k_proj",
    "attn.to_add_out",
    "img_mlp.net.2",
    "txt_mlp.net.0.proj",
    "img_mod.1",
)
ASK = dict(
    prompt="a cat",
    negative_prompt=" ",
    true_cfg_scale=4.0,
    height=32,
    width=48,
    num_inference_steps=2,
    seed=5,
)


def lora_pairs(model: torch.nn.Module, seed: int, rank: int = 4) -> dict:
    """A random LoRA on every block's TARGETS, keyed as diffusers saves them (``lora_A/B.weight``)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, _ in enumerate(model.transformer_blocks):
        for name in TARGETS:
            linear = model.get_submodule(f"transformer_blocks.{i}.{name}")
            key = f"transformer.transformer_blocks.{i}.{name}"
            out[f"{key}.lora_A.weight"] = torch.randn(rank, linear.in_features, generator=g) * 0.3
            out[f"{key}.lora_B.weight"] = torch.randn(linear.out_features, rank, generator=g) * 0.3
    return out


@pytest.fixture(scope="module")
def model(qwen_host, tiny_path):
    return fv_core.load("qwen-image-tiny", tiny_path, host=qwen_host)


@pytest.fixture(scope="module")
def loras(model, tmp_path_factory) -> dict:
    root, dit = tmp_path_factory.mktemp("loras"), model.instance.component("transformer")
    files = {}
    for name, seed in (("style", 1), ("detail", 2)):
        files[name] = root / f"{name}.safetensors"
        save_file(lora_pairs(dit, seed), files[name])
        model.instance.adapters.add(name, files[name])
    return files


def reference(pipe, files: dict, scales: list[float]) -> np.ndarray:
    for name, path in files.items():
        pipe.load_lora_weights(str(path), adapter_name=name)
    pipe.set_adapters(list(files), scales)
    try:
        kw = {k: v for k, v in ASK.items() if k != "seed"}
        return pipe(**kw, generator=torch.Generator().manual_seed(ASK["seed"]), output_type="np").images[0]
    finally:
        pipe.unload_lora_weights()


@pytest.mark.parametrize("names,scales", [(["style", "detail"], [0.7, -0.4])])  # two: each is applied, scaled
def test_c1_adapters_match_diffusers_set_adapters(model, loras, pipe, names, scales):
    ref = reference(pipe, {n: loras[n] for n in names}, scales)
    got = model.generate(**ASK, adapters=list(zip(names, scales, strict=True))).image
    plain = model.generate(**ASK).image
    assert np.abs(got - ref).max() <= model.card.parity.tolerances["frames"]
    assert np.abs(got - plain).max() > 1e-3, "the adapter changes the image"
