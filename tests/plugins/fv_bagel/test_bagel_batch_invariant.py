"""BAGEL under bitwise batching: the exact (row-invariant) instance's denoise steps declare an invariant
body, so two t2i requests share calls and each gets its bytes alone."""

from __future__ import annotations

import torch

from fv_core.runtime import Engine


def test_exact_t2i_denoise_steps_batch_under_bitwise_and_keep_the_bytes(bagel):
    assert bagel.instance.exact

    def items():
        prompts = [("a red cat", 3), ("blue car", 4)]
        return [
            bagel.job(
                bagel.prepare({"prompt": p, "num_inference_steps": 2, "seed": s}, task="t2i", request_id=p)
            )
            for p, s in prompts
        ]

    engine = Engine()
    with torch.no_grad():
        batched = engine.run_batched(items(), batching="invariant")
        serial = Engine().run_serial(items())
    assert engine.decisions.batch > 0
    for a, b in zip(serial, batched, strict=True):
        assert a is not None and b is not None
        assert all(
            torch.equal(a.outputs[k], b.outputs[k])
            for k in a.outputs
            if isinstance(a.outputs[k], torch.Tensor)
        )
