"""The interleave gate (interleaved == serial, bit for bit) and batched parity on the Wan cards."""

from __future__ import annotations

from wan_support import request

from fv_core.parity import assert_interleave_parity, check_batched_parity
from fv_core.runtime import Engine
from fv_wan.cards import fastwan_1_3b
from fv_wan.loop import WanLoop
from fv_wan.model import WanModel


def test_interleave_gate_mixed_requests(tiny_model, tiny_path):
    fastwan = WanModel(fastwan_1_3b(), tiny_path)  # FastWan's 3-step DMD loop on the tiny weights

    def items():
        return [
            (WanLoop(), request("a", seed=1, prompt="a dog on the beach", steps=2), tiny_model),
            (
                WanLoop(),
                request(
                    "b", seed=2, prompt="a red car in the city", height=48, width=32, steps=4, sampler="euler"
                ),
                tiny_model,
            ),
            (WanLoop(), request("c", seed=3, num_frames=9, steps=3, cfg_mode="batched"), tiny_model),
            (
                WanLoop(),
                request(
                    "d",
                    seed=4,
                    prompt="a boat at sunset",
                    num_frames=1,
                    steps=3,
                    guidance=1.0,
                    task="text_to_image",
                ),
                tiny_model,
            ),
            (
                WanLoop(),
                request("e", seed=5, prompt="a bird flying", steps=3, guidance=1.0, sampler="dmd"),
                fastwan,
            ),
        ]

    report = assert_interleave_parity(Engine, items)
    assert report.ok and report.max_abs == 0.0


def test_batched_parity_within_declared_tolerance(tiny_model):
    def items():
        return [
            (WanLoop(), request(f"r{i}", seed=i, prompt=p), tiny_model)
            for i, p in enumerate(["a cat", "a dog in the snow", "a horse running", "a fish"])
        ]

    tol = tiny_model.card.parity.tolerances["frames_batched_cfg"]
    assert check_batched_parity(Engine, items, tol).ok
