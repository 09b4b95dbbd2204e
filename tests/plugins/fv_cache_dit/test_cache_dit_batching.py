"""Cached requests in one batch: every block runs once, for exactly the rows that need it, and each
request's rows equal its solo cached forward."""

from __future__ import annotations

import torch

from fv_cache_dit import DBCache, FBCache
from fv_cache_dit.options import CacheDiTOptions
from fv_core.extend import BlockHook, BlockHooks, drive_blocks

BLOCKS, TOKENS, DIM = 5, 4, 8


class Blocks:
    """Row-wise elementwise blocks (so batched rows are bit-identical to solo rows), counting calls."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        self.scale = torch.rand(BLOCKS, DIM, generator=gen) + 0.5
        self.calls: list[tuple[int, int]] = []  # (block, rows) of every call

    def __call__(self, index: int, hidden: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        self.calls.append((index, hidden.shape[0]))
        return torch.tanh(hidden * self.scale[index]) + 0.01 * index


def caches(icp, **options) -> dict:
    return {"options": icp.options.model_copy(update=options).model_dump()}


PLANS = [  # (interceptor, its request's options); None: a request without caching
    (FBCache(), dict(residual_diff_threshold=0.001, max_warmup_steps=1)),
    (FBCache(), dict(residual_diff_threshold=0.5, max_warmup_steps=1)),
    (None, {}),
    (
        DBCache(Fn_compute_blocks=2, Bn_compute_blocks=1),
        dict(residual_diff_threshold=0.3, max_warmup_steps=1, max_continuous_cached_steps=1),
    ),
]


def test_batched_rows_equal_each_solo_forward_bit_for_bit_and_skipped_spans_do_not_run():
    base = torch.randn(len(PLANS), TOKENS, DIM, generator=torch.Generator().manual_seed(1))
    solo = [caches(icp, **o) if icp else None for icp, o in PLANS]
    batch = [caches(icp, **o) if icp else None for icp, o in PLANS]
    blocks, counted = Blocks(), Blocks()
    span_rows = []
    for step in range(6):
        x = base * (1 + 0.03 * step)  # slowly changing inputs, as over denoising steps
        want = [
            drive_blocks(BlockHook(icp, c) if icp else None, "main", x[i : i + 1], BLOCKS, blocks)
            for i, ((icp, _), c) in enumerate(zip(PLANS, solo, strict=True))
        ]
        hooks = BlockHooks(
            [(BlockHook(icp, c) if icp else None, 1) for (icp, _), c in zip(PLANS, batch, strict=True)]
        )
        counted.calls.clear()
        got = drive_blocks(hooks, "main", x, BLOCKS, counted)
        assert torch.equal(got, torch.cat(want))
        assert [index for index, _ in counted.calls] == list(range(BLOCKS))  # each block: at most one call
        span_rows.append(dict(counted.calls)[2])  # block 2 is in both FBCache spans and DBCache's
    decisions = [[c["main"].get("cached_steps", []) if c else [] for c in run] for run in (solo, batch)]
    assert decisions[0] == decisions[1]  # the same decisions, request by request
    assert len({len(d) for d in decisions[1]}) > 2, decisions  # ... and different ones: thresholds differ
    assert min(span_rows) < len(PLANS)  # some rows skipped the span in one call
    assert all(rows >= 1 for rows in span_rows)  # the uncached request always runs it


def test_a_solo_forward_is_the_span_driver_with_one_plan():
    icp, x = FBCache(), torch.randn(2, TOKENS, DIM)
    one, other = (caches(icp, residual_diff_threshold=0.9, max_warmup_steps=1) for _ in range(2))
    for _ in range(3):
        a = icp.run_blocks(one, "cond", x, BLOCKS, Blocks())
        b = drive_blocks(BlockHooks([(BlockHook(icp, other), 2)]), "cond", x, BLOCKS, Blocks())
        assert torch.equal(a, b)
    assert one["cond"]["cached_steps"] == other["cond"]["cached_steps"] == [1, 2]
    assert CacheDiTOptions.model_validate(one["options"]).Fn_compute_blocks == 1
