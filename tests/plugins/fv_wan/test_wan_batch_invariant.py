"""Batch invariance on Wan (``determinism: bitwise`` batching): requests whose steps share calls through
their invariant bodies give each request's bytes alone; the plain batched bodies (and the invariant
body with its per-row embeddings undone) do not, so these tests can fail."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from wan_support import request

import fv_core
from fv_core.loop import Profile, run_plan
from fv_core.request import ImagePart
from fv_core.runtime import Engine, SchedulingPolicy
from fv_wan import transformer
from fv_wan.t2v_loop import WanLoop

PROMPTS = ("a cat", "a dog in the snow at night", "a red car in the city", "a boat")
SMALL = dict(num_frames=1, height=32, width=32, num_inference_steps=2, max_sequence_length=64)


def items(model):
    """Four requests: three with two-forward CFG, prompts of different lengths and seeds, and one
    without CFG (its steps batch only with its own kind)."""
    out = [
        (WanLoop(model), request(model, f"r{i}", seed=i, prompt=p, **SMALL), model)
        for i, p in enumerate(PROMPTS[:3])
    ]
    out.append(
        (
            WanLoop(model),
            request(model, "n", seed=9, prompt=PROMPTS[3], guidance_scale=1.0, **SMALL),
            model,
        )
    )
    return out


@pytest.fixture(scope="module")
def invariant_and_serial(tiny_model):
    """The requests under invariant batching first (so their prompt encodes and text keys/values batch
    too, before the text caches hold them), then each alone (on those caches)."""
    results, calls = batched(tiny_model, "invariant")
    with torch.no_grad():
        return results, calls, Engine().run_serial(items(tiny_model))


@pytest.fixture(scope="module")
def serial(invariant_and_serial):
    return invariant_and_serial[2]


def batched(model, batching, policy="fair"):
    """The requests interleaved under ``batching`` and the scheduling ``policy``, and the batched calls
    made."""
    engine = Engine(scheduling=SchedulingPolicy(policy=policy))
    with torch.no_grad():
        results = engine.run_batched(items(model), batching=batching)
    return results, engine.decisions.batch


def same_bytes(a, b) -> bool:
    return all(
        torch.equal(x.outputs[k], y.outputs[k])
        for x, y in zip(a, b, strict=True)
        for k in ("frames", "latents")
    )


def test_bitwise_batching_equals_each_request_alone(invariant_and_serial):
    results, calls, serial = invariant_and_serial
    assert calls > 0, "the invariant steps shared calls"
    assert same_bytes(serial, results)


def test_auto_policy_batches_invariant_steps_and_keeps_the_bytes(tiny_model, serial):
    results, calls = batched(tiny_model, "invariant", "auto")
    assert calls > 0 and same_bytes(serial, results)


def test_plain_batched_bodies_differ(tiny_model, serial):
    results, calls = batched(tiny_model, True)
    assert calls > 0 and not same_bytes(serial, results)


def test_undoing_the_per_row_embeddings_breaks_it(tiny_model, serial, monkeypatch):
    """The mutation: the patch and timestep embeddings over the whole batch (one GEMM and convolution of
    every row, their reduction order changing with the batch) instead of per row."""
    monkeypatch.setattr(transformer, "per_row", lambda fn, *tensors: fn(*tensors))
    results, calls = batched(tiny_model, "invariant")
    assert calls > 0 and not same_bytes(serial, results)


def test_batched_cfg_declares_no_invariant_body(tiny_model):
    """Batched CFG (two rows per plan, attending to folded keys/values together) is not invariant: its
    steps run alone under bitwise."""
    loop = WanLoop(tiny_model)
    with torch.no_grad():
        state = loop.init(request(tiny_model, "c", cfg_mode="batched", **SMALL), tiny_model)
        while state.values["phase"] != "denoise":
            state = loop.advance(state, run_plan(loop.next(state), Profile.SERVE))
    plan = loop.next(state)
    assert plan.batch_key is not None and plan.invariant_body is None


@pytest.mark.parametrize("variant,task", [("ti2v", "t2v"), ("i2v", "i2v")])
def test_variants_under_bitwise_batching_equal_each_request_alone(variant_folders, wan_host, variant, task):
    """Wan2.2 TI2V (a timestep per token) and Wan2.1 I2V (image keys/values beside the text's)."""
    model = fv_core.load(weights=variant_folders[variant, "first"], host=wan_host)
    size = dict(SMALL, num_frames=5, height=64, width=64)  # TI2V: 2 x 2 x 2 tokens (one alone is a GEMV)
    image = np.random.default_rng(7).random((32, 32, 3)).astype(np.float32)
    parts = [ImagePart(image)] if task == "i2v" else []

    def make():
        return [
            (
                model.runnable(task),
                model.prepare({**size, "prompt": p, "seed": i, "guidance_scale": 3.0}, task=task, parts=parts,
                              request_id=f"{variant}{i}"),
                model.instance,
            )
            for i, p in enumerate(PROMPTS[:2])
        ]  # fmt: skip

    engine = Engine()
    with torch.no_grad():
        results = engine.run_batched(make(), batching="invariant")  # first: its text steps batch too
        serial = Engine().run_serial(make())
    assert engine.decisions.batch > 0 and same_bytes(serial, results)
