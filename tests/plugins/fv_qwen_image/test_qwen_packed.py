"""Packed batching on Qwen-Image: requests of different sizes and prompt lengths share each step as one
sequence (a deploy selects a packed_attention kernel), each equal to itself alone within the card's
tolerance, and bit for bit under determinism: bitwise (the plans' invariant body, linears per request)."""

from __future__ import annotations

import pytest
import torch

import fv_core
from fv_core import kernels_packed
from fv_core.deploy.card import parse_deploy
from fv_core.parity import compare_results
from fv_core.runtime import Engine
from fv_core.runtime.policy import SchedulingPolicy
from tests.denoise_calls import DenoiseCalls

# four sizes (square, wide, tall, small), prompts of other lengths; true CFG on for three (one call per
# CFG mode: the fourth runs alone)
ASKS = [
    dict(prompt="a cat", height=32, width=32, seed=1, negative_prompt=" ", true_cfg_scale=4.0),
    dict(
        prompt="a dog in the snow at night",
        height=16,
        width=48,
        seed=2,
        negative_prompt=" ",
        true_cfg_scale=4.0,
    ),
    dict(prompt="a cow", height=32, width=16, seed=3, negative_prompt="blur", true_cfg_scale=2.0),
    dict(prompt="two red apples on a wooden table", height=16, width=16, seed=4),
]


@pytest.fixture(scope="module")
def packed_model(qwen_host, tiny_path):
    deploy = parse_deploy(
        {
            "plugins": ["fv-qwen-image"],
            "models": [
                {
                    "card": "qwen-image-tiny",
                    "weights": tiny_path,
                    "kernels": {"packed_attention": "segments"},
                }
            ],
        }
    )
    return fv_core.load("qwen-image-tiny", deploy=deploy, host=qwen_host)


def items(model, asks=ASKS):
    return [
        model.job(model.prepare({**a, "num_inference_steps": 2}, request_id=f"p{i}"))
        for i, a in enumerate(asks)
    ]


def test_mixed_sizes_pack_into_one_step_equal_alone_and_bitwise_under_determinism_bitwise(packed_model):
    """Batched (packed) within the card's tolerance of serial; under determinism: bitwise (batching
    through the plans' invariant body) packed too, and bit for bit serial."""
    calls, bitwise_calls = DenoiseCalls(), DenoiseCalls()
    fair = SchedulingPolicy("fair")
    with torch.no_grad():
        serial = Engine().run_serial(items(packed_model))
        packed = Engine(observers=[calls], scheduling=fair).run_batched(items(packed_model))
        bitwise = Engine(observers=[bitwise_calls], scheduling=fair).run_batched(
            items(packed_model), batching="invariant"
        )
    report = compare_results(
        serial, packed, "batched", tolerance=packed_model.card.parity.tolerances["frames"]
    )
    assert report.ok and 0 < report.max_abs and max(calls.sizes) == 3, (calls.sizes, str(report))
    gate = compare_results(serial, bitwise, "bitwise", tolerance=0.0)
    assert gate.ok and gate.max_abs == 0.0, str(gate)
    assert max(bitwise_calls.sizes) == 3, bitwise_calls.sizes  # the three true-CFG requests share each step
    assert packed[3].metrics["kernels"]["packed_attention"]["variant"] == "segments"


@pytest.mark.parametrize("variant", ["segments", "sdpa", "padded"])
def test_packed_body_equals_each_request_alone(packed_model, variant):
    """One transformer forward of four packed requests vs each alone: float rounding only (the packed
    call's matmuls run over all tokens at once, so not bit for bit)."""
    from fv_qwen_image.transformer import qwen_forward, qwen_forward_packed

    dit = packed_model.instance.component("transformer")
    kernel = getattr(kernels_packed, f"packed_{variant}")
    grids, text_lens = [(1, 2, 2), (1, 2, 4), (1, 3, 1), (1, 1, 1)], [3, 9, 2, 6]
    gen = torch.Generator().manual_seed(0)
    lat = [torch.randn(1, g[1] * g[2], 64, generator=gen) for g in grids]
    txt = [torch.randn(1, n, dit.config.joint_attention_dim, generator=gen) for n in text_lens]
    t = torch.tensor([0.9, 0.4, 0.7, 0.1])
    with torch.no_grad():
        packed = qwen_forward_packed(
            dit, torch.cat(lat, 1), t, torch.cat(txt, 1), grids, [x.shape[1] for x in lat], text_lens, kernel
        )
        alone = [
            qwen_forward(dit, x, t[i : i + 1], y, g)
            for i, (x, y, g) in enumerate(zip(lat, txt, grids, strict=True))
        ]
    for part, ref in zip(packed.split([x.shape[1] for x in lat], 1), alone, strict=True):
        assert (part - ref).abs().max() < 1e-5
    assert not torch.equal(
        packed[:, : lat[0].shape[1]], alone[1][:, : lat[0].shape[1]]
    )  # not the neighbour's


def test_the_exact_packed_body_is_bit_for_bit_each_request_alone(packed_model):
    """The plans' invariant body (determinism: bitwise packs through it): the linears per request make the
    segments kernel's packed forward bit for bit each request alone, where the one-call linears differ."""
    from fv_qwen_image.transformer import qwen_forward, qwen_forward_packed

    dit = packed_model.instance.component("transformer")
    grids, text_lens = [(1, 2, 2), (1, 2, 4), (1, 3, 1), (1, 1, 1)], [3, 9, 2, 6]
    gen = torch.Generator().manual_seed(1)
    lat = [torch.randn(1, g[1] * g[2], 64, generator=gen) for g in grids]
    txt = [torch.randn(1, n, dit.config.joint_attention_dim, generator=gen) for n in text_lens]
    t, lens = torch.tensor([0.9, 0.4, 0.7, 0.1]), [x.shape[1] for x in lat]
    with torch.no_grad():
        alone = [
            qwen_forward(dit, x, t[i : i + 1], y, g)
            for i, (x, y, g) in enumerate(zip(lat, txt, grids, strict=True))
        ]
        packed = {
            exact: qwen_forward_packed(
                dit, torch.cat(lat, 1), t, torch.cat(txt, 1), grids, lens, text_lens,
                kernels_packed.packed_segments, exact,
            ).split(lens, 1)
            for exact in (True, False)
        }  # fmt: skip
    assert all(torch.equal(part, ref) for part, ref in zip(packed[True], alone, strict=True))
    assert not all(torch.equal(part, ref) for part, ref in zip(packed[False], alone, strict=True))


def test_only_a_row_exact_kernel_gives_the_plans_an_invariant_body(packed_model, qwen_host, tiny_path):
    def denoise_plan(model):
        loop = model.loop("t2i")
        state = loop.init(model.prepare({**ASKS[0], "num_inference_steps": 2}))
        for row in state.values["rows"]:  # the prompt rows as the encoder would leave them
            state.tensors[row] = torch.zeros(
                1, 3, model.instance.config("transformer/config.json")["joint_attention_dim"]
            )
        return loop.next(state)

    assert denoise_plan(packed_model).invariant_body is not None
    deploy = parse_deploy(
        {
            "plugins": ["fv-qwen-image"],
            "models": [
                {"card": "qwen-image-tiny", "weights": tiny_path, "kernels": {"packed_attention": "sdpa"}}
            ],
        }
    )
    masked = fv_core.load("qwen-image-tiny", deploy=deploy, host=qwen_host)
    plan = denoise_plan(masked)
    assert plan.packed and plan.invariant_body is None
