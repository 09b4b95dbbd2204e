"""Parallel groups start, fail, restart and stop: a wrong plan fails before any process starts, a dead
worker fails its step with the rank and exit code and the group restarts for the next, close stops every
worker; and the trained shapes card equals one process under every plan."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from parallel_support import PLANS, SHAPES, TINY, assert_close, deploy, plugin_host, run

from fv_core import Cancelled, ConfigError
from fv_core.deploy.card import parse_deploy
from fv_core.load import load
from fv_core.parallel import WorkerFailed
from fv_core.runtime import Engine


@pytest.fixture(scope="module")
def host():
    return plugin_host()


@pytest.fixture(scope="module")
def tiny_reference(host):
    """The tiny card's one-process result (FBCache on)."""
    return run(load("wan2.1-t2v-tiny", deploy=deploy("wan2.1-t2v-tiny"), host=host), TINY)


@contextmanager
def group(host, plan: str, card: str = "wan2.1-t2v-tiny", plan_deploy=None) -> Iterator:
    """``card`` (FBCache on, or ``plan_deploy``) on a parallel group, closed after."""
    model = load(card, deploy=plan_deploy or deploy(card), host=host, parallel=plan)
    try:
        yield model
    finally:
        model.close()


def test_shapes_card_matches_one_process(host):
    reference = run(load("wan2.1-t2v-shapes", deploy=deploy("wan2.1-t2v-shapes"), host=host), SHAPES)
    for plan in PLANS:
        with group(host, plan, "wan2.1-t2v-shapes") as model:
            assert_close(reference, run(model, SHAPES))


def test_sta_runs_on_each_rank_of_a_sequence_parallel_group(host):
    """The kernel registry still applies: STA sees all tokens (its grid) and this rank's heads."""
    sta = parse_deploy(
        {
            "plugins": ["fv-wan", "fv-sta"],
            "models": [{"card": "wan2.1-t2v-tiny", "kernels": {"attention": "sta"}}],
            "plugin_options": {"fv-sta": {"windows": [{"tile": [1, 2, 2], "window": [1, 1, 1]}]}},
        }
    )
    reference = run(load("wan2.1-t2v-tiny", deploy=sta, host=host), TINY)
    with group(host, "sp=2", plan_deploy=sta) as model:
        result = run(model, TINY)
    assert_close(reference, result)
    assert result.metrics["kernels"]["attention"]["variant"] == "sta"


def test_cancel_stops_at_a_step_boundary_and_the_group_serves_on(host, tiny_reference):
    """Workers hold no request state: a request cancelled mid-run leaves nothing behind on any rank."""
    with group(host, "sp=2,cfg=2") as model:
        engine = Engine(
            on_event=lambda e: e.kind == "progress" and e.step == 2 and engine.cancel(e.request_id)
        )
        with pytest.raises(Cancelled):
            engine.run_one(*model.job(model.prepare(TINY)))
        assert_close(tiny_reference, run(model, TINY))


def test_dead_worker_fails_its_step_then_the_group_restarts(host, tiny_reference):
    """Killing a rank mid-job fails that job with the rank and its exit code; the next job succeeds."""
    with group(host, "cfg=2") as model:
        victim = model.parallel.alive_workers()[0]
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(WorkerFailed, match=r"lost a worker during denoise.*rank 1 \(exit code -9\)"):
            run(model, TINY)
        assert_close(tiny_reference, run(model, TINY))
        assert model.parallel.restarts == 1 and victim not in model.parallel.alive_workers()


def test_a_step_that_raises_fails_alone_and_the_group_restarts(host, tiny_reference):
    """A step that raises on every rank (no timestep): rank 0 raises its own error at once (the workers
    exit instead of leaving rank 0 in a collective) and the next request runs on a fresh group."""
    with group(host, "sp=2") as model:
        inputs = {"latents": torch.zeros(1, 16, 2, 4, 6), "kv": torch.zeros(1, 2, 2, 8, 32)}
        with pytest.raises(KeyError, match="timestep"):
            model.parallel.run("fv_wan.parallel:denoise_shard", "transformer", inputs, label="bad step")
        assert_close(tiny_reference, run(model, TINY))
        assert model.parallel.restarts == 1


def test_close_stops_every_worker(host):
    model = load("wan2.1-t2v-tiny", host=host, parallel="sp=2")
    workers = list(model.parallel._procs)
    model.close()
    assert [p.poll() for p in workers] == [0], "the worker exited cleanly on shutdown"
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize(
    "plan, message",
    [
        ("sp=4", "sequence degree 4 does not divide the 2 attention heads"),
        ("cfg=3", "cfg degree 3 exceeds the card's maximum 2"),
        ("sp=16", "sequence degree 16 exceeds the card's maximum 8"),
        ("tp=2", "tensor parallelism is not implemented"),
        ("sp=2,cfg=2,dp=2", "data degree 2 exceeds the card's maximum 1"),
        ("sp=two", "'sp=two' is not AXIS=DEGREE"),
    ],
)
def test_wrong_plan_fails_before_any_process_starts(host, plan, message):
    with pytest.raises(ConfigError, match=message):
        load("wan2.1-t2v-tiny", host=host, parallel=plan)
    assert not torch.distributed.is_initialized()
