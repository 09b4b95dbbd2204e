"""Wan on parallel groups (gloo processes on CPU): sp=2, cfg=2 and sp=2 x cfg=2 equal one process within
the declared tolerance, with FBCache on; the interleave gate holds inside a group; a dead worker fails
its step clearly and the group restarts (test_wan_parallel_lifecycle.py).

One group lives at a time (a process holds one torch.distributed group): the module fixture is
parametrized by plan, so pytest finishes every test of one plan before it starts the next group.
"""

from __future__ import annotations

import pytest
from parallel_support import PLANS, TINY, assert_close, deploy, plugin_host, run

from fv_core.load import load
from fv_core.parity import assert_interleave_parity
from fv_core.runtime import Engine


@pytest.fixture(scope="module")
def host():
    return plugin_host()


@pytest.fixture(scope="module")
def single(host):
    """One-process results of every request the tests compare against."""
    tiny = load("wan2.1-t2v-tiny", deploy=deploy("wan2.1-t2v-tiny"), host=host)
    return {
        "tiny": run(tiny, TINY),
        "batched": run(tiny, {**TINY, "cfg_mode": "batched"}),
        "uneven": run(tiny, {**TINY, "num_frames": 1, "height": 48, "width": 16}),
    }


@pytest.fixture(scope="module", params=PLANS)
def group(request, host):
    model = load("wan2.1-t2v-tiny", deploy=deploy("wan2.1-t2v-tiny"), host=host, parallel=request.param)
    yield model
    model.close()


def test_matches_one_process(group, single):
    result = run(group, TINY)
    assert_close(single["tiny"], result)
    assert result.metrics["cache_dit"]["cached"] > 0, "FBCache skipped blocks in the group too"


def test_batched_cfg_matches_one_process(group, single):
    assert_close(single["batched"], run(group, {**TINY, "cfg_mode": "batched"}))


def test_uneven_token_shards(group, single):
    """3 tokens over 2 sequence ranks: shards of 2 and 1."""
    assert_close(single["uneven"], run(group, {**TINY, "num_frames": 1, "height": 48, "width": 16}))


def test_interleave_gate_inside_group(group):
    def items():
        requests = [group.prepare({**TINY, "seed": s}) for s in (1, 2)]
        return [group.job(r) for r in requests]

    assert_interleave_parity(Engine, items)


def test_provenance_names_the_plan(group):
    artifact = group.generate(**{**TINY, "num_inference_steps": 2})
    assert artifact.provenance["deploy"]["parallel"] == group.parallel.plan.id


def test_text_keys_values_cross_to_workers_once(group):
    """A request's text K/V (2 prompt rows x 2 blocks x 2 x 512 tokens x 32 x fp32) reach each worker once,
    not at each of its 5 steps."""
    from fv_core.parallel import TRAFFIC

    kv_bytes, workers = 2 * 2 * 2 * 512 * 32 * 4, group.parallel.plan.world_size - 1
    before = TRAFFIC.bytes.get("broadcast", 0)
    run(group, {**TINY, "prompt": "a prompt no other test used"})
    sent = TRAFFIC.bytes["broadcast"] - before
    assert kv_bytes * workers <= sent < 2 * kv_bytes * workers
