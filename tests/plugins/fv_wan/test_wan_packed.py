"""Packed batching on Wan: requests of different sizes and frame counts share each step as one
sequence (a deploy selects a packed_attention kernel), self-attention confined to each request and
cross-attention to each request's own prompt; batched equals serial within the card's batched
tolerance, and the interleave gate (bitwise mode's path) holds with mixed sizes."""

from __future__ import annotations

import pytest
import torch

import fv_core
from fv_core import kernels_packed
from fv_core.deploy.card import parse_deploy
from fv_core.parity import compare_results
from fv_core.runtime import Engine
from fv_core.runtime.policy import SchedulingPolicy
from fv_wan.tiny import TINY_ID
from tests.denoise_calls import DenoiseCalls

# three sizes and frame counts, prompts of other lengths (folded: each request its own text length)
ASKS = [
    dict(prompt="a dog on the beach", num_frames=5, height=32, width=32, seed=1),
    dict(prompt="a red car", num_frames=9, height=16, width=48, seed=2),
    dict(prompt="a small boat on a lake at dawn", num_frames=1, height=48, width=16, seed=3),
]


@pytest.fixture(scope="module")
def packed_model(wan_host, tiny_path):
    deploy = parse_deploy(
        {
            "plugins": ["fv-wan"],
            "models": [{"card": TINY_ID, "weights": tiny_path, "kernels": {"packed_attention": "segments"}}],
        }
    )
    return fv_core.load(TINY_ID, deploy=deploy, host=wan_host)


def items(model):
    return [
        model.job(model.prepare({**a, "num_inference_steps": 2}, request_id=f"w{i}"))
        for i, a in enumerate(ASKS)
    ]


def test_mixed_sizes_and_frame_counts_pack_into_one_step(packed_model):
    calls = DenoiseCalls()
    with torch.no_grad():
        serial = Engine().run_serial(items(packed_model))
        packed = Engine(observers=[calls], scheduling=SchedulingPolicy("fair")).run_batched(
            items(packed_model)
        )
        interleaved = Engine().run_interleaved(items(packed_model))
    tol = packed_model.card.parity.tolerances["frames"]
    report = compare_results(serial, packed, "batched", tolerance=tol)
    assert report.ok and max(calls.sizes) == len(ASKS), (calls.sizes, str(report))
    gate = compare_results(serial, interleaved, "interleave", tolerance=0.0)
    assert gate.ok and gate.max_abs == 0.0, str(gate)
    assert packed[0].metrics["kernels"]["packed_attention"]["variant"] == "segments"


def test_packed_forward_equals_each_request_alone(packed_model):
    """One packed forward of three requests (own latent shapes, timesteps and prompts) vs each alone."""
    from fv_wan.packed import wan_forward_packed
    from fv_wan.transformer import text_kv, wan_forward_kv

    dit = packed_model.instance.component("transformer")
    gen = torch.Generator().manual_seed(0)
    shapes, texts = [(1, 4, 4), (3, 2, 6), (2, 6, 2)], (7, 3, 12)
    lat = [torch.randn(1, 16, f, h, w, generator=gen) for f, h, w in shapes]
    kv = [text_kv(dit, torch.randn(1, n, dit.config.text_dim, generator=gen)) for n in texts]
    t = torch.tensor([900.0, 500.0, 100.0])
    with torch.no_grad():
        packed = wan_forward_packed(dit, lat, t, kv, kernels_packed.packed_segments)
        alone = [wan_forward_kv(dit, x, t[i : i + 1], kv[i]) for i, x in enumerate(lat)]
    for part, ref in zip(packed, alone, strict=True):
        assert part.shape == ref.shape and (part - ref).abs().max() < 1e-5
