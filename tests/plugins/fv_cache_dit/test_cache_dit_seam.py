"""The block seam in the runner: hooks attach per request, commit after the step, never half-way."""

from __future__ import annotations

from dataclasses import replace

import pytest
from cache_dit_support import BlockDenoiseLoop, request

from fv_cache_dit import DBCache
from fv_core.extend import BLOCKS_INPUT, BlockHook
from fv_core.loop import LoopContext, LoopRunner, run_plan
from fv_core.loop.seam import attach_block_hook

LOOP = BlockDenoiseLoop()


class Exploding(DBCache):
    """Runs the blocks (writing its cache), then fails the body."""

    def run_blocks(self, caches, branch, hidden, num_blocks, block):
        super().run_blocks(caches, branch, hidden, num_blocks, block)
        raise RuntimeError("boom")


def start(icp):
    runner, ctx = LoopRunner(), LoopContext(interceptors=(icp,))
    return runner, ctx, runner.start(LOOP, request("s", residual_diff_threshold=0.3), None, ctx)


def test_hook_is_attached_per_request_and_committed_after_the_step():
    runner, ctx, active = start(DBCache(Fn_compute_blocks=1))
    plan = runner.plan(active)
    assert isinstance(plan.inputs[BLOCKS_INPUT], BlockHook) and plan.batch_key is not None  # batchable
    run = run_plan(plan, ctx.profile)
    assert "cond" not in active.state.plugin_state["fv-cache-dit"]  # nothing written during the body
    runner.complete(active, plan, run)
    assert active.state.plugin_state["fv-cache-dit"]["cond"]["step"] == 0
    plain = LoopRunner()
    bare = plain.start(LOOP, request("b"), None, LoopContext())
    assert plain.plan(bare).inputs[BLOCKS_INPUT] is None and plain.plan(bare).batch_key is not None


def test_a_failing_body_leaves_the_request_state_as_it_was():
    runner, ctx, active = start(Exploding(Fn_compute_blocks=1))
    options = dict(active.state.plugin_state["fv-cache-dit"])
    with pytest.raises(RuntimeError, match="boom"):
        run_plan(runner.plan(active), ctx.profile)
    assert active.state.plugin_state["fv-cache-dit"] == options


class WholeForward:
    """A block interceptor that only knows whole forwards (no span methods): its plans cannot batch."""

    plugin_id, kind, name = "whole", "block_skip", "whole"

    def run_blocks(self, caches, branch, hidden, num_blocks, block):
        for i in range(num_blocks):
            hidden = block(i, hidden)
        return hidden


def test_only_span_interceptors_in_one_process_keep_the_batch_key():
    runner = LoopRunner()
    whole = runner.start(LOOP, request("w"), None, LoopContext(interceptors=(WholeForward(),)))
    assert runner.plan(whole).batch_key is None
    _, _, active = start(DBCache(Fn_compute_blocks=1))
    plan = LOOP.next(active.state)
    on_group = replace(plan, batch_key=replace(plan.batch_key, parallel_plan="sp2"))
    assert attach_block_hook(active.state, on_group, (DBCache(),)).batch_key is None
