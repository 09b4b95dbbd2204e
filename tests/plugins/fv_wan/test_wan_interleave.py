"""The interleave gate (interleaved == serial, bit for bit) and batched parity on the Wan cards."""

from __future__ import annotations

from wan_support import request, tiny_instance

from fv_core.parity import assert_interleave_parity, check_batched_parity
from fv_core.runtime import Engine
from fv_wan.cards import fastwan_1_3b
from fv_wan.t2v_loop import WanLoop


def test_interleave_gate_mixed_requests(tiny_model, tiny_path):
    fastwan = tiny_instance(tiny_path, fastwan_1_3b())  # FastWan's 3-step DMD loop on the tiny weights

    def items():
        return [
            (
                WanLoop(tiny_model),
                request(tiny_model, "a", seed=1, prompt="a dog on the beach", num_inference_steps=2),
                tiny_model,
            ),
            (
                WanLoop(tiny_model),
                request(
                    tiny_model,
                    "b",
                    seed=2,
                    prompt="a red car in the city",
                    height=48,
                    width=32,
                    num_inference_steps=4,
                    sampler="euler",
                ),
                tiny_model,
            ),
            (
                WanLoop(tiny_model),
                request(tiny_model, "c", seed=3, num_frames=9, num_inference_steps=3, cfg_mode="batched"),
                tiny_model,
            ),
            (
                WanLoop(tiny_model),
                request(
                    tiny_model,
                    "d",
                    seed=4,
                    prompt="a boat at sunset",
                    num_frames=1,
                    num_inference_steps=3,
                    guidance_scale=1.0,
                    task="t2i",
                ),
                tiny_model,
            ),
            (
                WanLoop(fastwan),
                request(
                    fastwan, "e", seed=5, prompt="a bird flying", num_inference_steps=3, guidance_scale=1.0
                ),
                fastwan,
            ),
        ]

    report = assert_interleave_parity(Engine, items)
    assert report.ok and report.max_abs == 0.0


def test_batched_parity_within_declared_tolerance(tiny_model):
    def items():
        return [
            (WanLoop(tiny_model), request(tiny_model, f"r{i}", seed=i, prompt=p), tiny_model)
            for i, p in enumerate(["a cat", "a dog in the snow", "a horse running", "a fish"])
        ]

    tol = tiny_model.card.parity.tolerances["frames_batched_cfg"]
    assert check_batched_parity(Engine, items, tol).ok
