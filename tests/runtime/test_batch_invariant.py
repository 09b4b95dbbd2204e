"""The batch-invariance contract in the runtime: under ``Batching "invariant"`` (``determinism: bitwise``)
only plans with an ``invariant_body`` share a call, and the call runs through it; the core's pieces
(``per_row``, the measured probes) tell a row-invariant op from one that is not."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from fv_core.loop import (
    BatchKey,
    Profile,
    WorkPlan,
    WorkUnitKind,
    gemm_rows_invariant,
    per_row,
    rows_invariant,
)
from fv_core.runtime.batching import Batch, group_calls, run_batch

KEY = BatchKey("m#0/t", "denoise", (4,), "float32")


def doubled(inputs):
    return {"y": inputs["x"] * 2}


def marked(inputs):
    return {"y": inputs["x"] * 2 + 1000}  # tells which body a call ran


def entry(invariant: bool) -> SimpleNamespace:
    plan = WorkPlan(
        WorkUnitKind.DIFFUSION_STEP,
        doubled,
        {"x": torch.ones(1, 4)},
        batch_key=KEY,
        invariant_body=marked if invariant else None,
    )
    return SimpleNamespace(pending=plan)


def test_only_invariant_plans_share_a_call_under_invariant_batching():
    entries = [entry(True), entry(False), entry(True), entry(False)]
    calls = group_calls(entries, "invariant", max_rows=8)
    assert len(calls) == 3 and isinstance(calls[0], Batch) and calls[0].invariant
    assert calls[0].entries == [entries[0], entries[2]] and calls[1:] == [entries[1], entries[3]]
    everything = group_calls(entries, True, max_rows=8)
    assert len(everything) == 1 and not everything[0].invariant
    assert group_calls(entries, False, max_rows=8) == entries


def test_an_invariant_call_runs_the_invariant_body():
    plans = [entry(True).pending, entry(True).pending]
    assert [r.outputs["y"][0, 0].item() for r in run_batch(plans, Profile.SERVE, invariant=True)] == [
        1002
    ] * 2
    assert [r.outputs["y"][0, 0].item() for r in run_batch(plans, Profile.SERVE)] == [2, 2]


def test_per_row_gives_each_row_its_lone_bits_where_the_batched_gemm_does_not():
    gen = torch.Generator().manual_seed(0)
    weight, x = torch.randn(64, 256, generator=gen), torch.randn(8, 256, generator=gen)
    alone = torch.cat([F.linear(x[i : i + 1], weight) for i in range(8)])
    assert torch.equal(per_row(lambda r: F.linear(r, weight), x), alone)
    # one row alone against eight in one call: the probe says whether they agree, and it is right
    assert gemm_rows_invariant(1, 256, 64) == torch.equal(F.linear(x, weight), alone)


def test_rows_invariant_catches_an_op_that_mixes_rows():
    assert rows_invariant(lambda x: x * 2, (4,), "cpu", torch.float32)
    assert not rows_invariant(lambda x: x - x.mean(0, keepdim=True), (4,), "cpu", torch.float32)
