"""Hot weight sync at the engine: a sync lands between two ticks while requests are mid-run.

Requests admitted before it finish bit for bit as on the old weights alone, those after as on the
new weights alone (references: fresh instances, the new weights loaded with plain
``load_state_dict``); only the synced component's cached features go; the replaced module is
freed once no request uses it; provenance names the version each request ran on.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

import fv_core
from fv_core import ConfigError, WeightsError
from fv_core.plugins import load_plugins
from fv_core.runtime import AsyncEngine, Engine, oom
from fv_core.training import WeightSyncPlan, sync_weights
from fv_core.training.sync import stage_sync
from fv_wan.tiny import tiny_weights

TINY = "wan2.1-t2v-tiny"
SHAPE = {"num_frames": 5, "height": 32, "width": 32, "num_inference_steps": 6, "guidance_scale": 1.0}
PLAN = WeightSyncPlan(role="student", components=["transformer"], version="step-1")


@pytest.fixture(scope="module")
def load(tmp_path_factory):
    """A fresh LoadedModel of the tiny card on one checkpoint folder, per call."""
    host = load_plugins(env={"FV_PLUGINS": "fv-wan"})
    path = tiny_weights(tmp_path_factory.mktemp("wan") / TINY)
    return lambda: fv_core.load(TINY, weights=path, host=host)


@pytest.fixture(scope="module")
def new_weights(load):
    """Every floating tensor of the tiny transformer, moved by seeded noise."""
    live = load().instance.component("transformer").state_dict()
    gen = torch.Generator().manual_seed(0)
    return {
        k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in live.items() if v.is_floating_point()
    }


@pytest.fixture(scope="module")
def old_ref(load):
    """An instance on the old weights only."""
    return load()


@pytest.fixture(scope="module")
def new_ref(load, new_weights):
    """An instance on the new weights only, loaded without fv's sync."""
    model = load()
    model.instance.component("transformer").load_state_dict(new_weights, strict=False)
    return model


def ask(model, rid, seed, prompt="a red circle moving left"):
    return model.prepare({"prompt": prompt, "seed": seed, **SHAPE}, request_id=rid)


def solo(model, request):
    with torch.no_grad():
        return Engine().run_one(*model.job(request))


def assert_same(result, ref):
    for name in ("frames", "latents"):
        assert torch.equal(result.outputs[name], ref.outputs[name]), name


def test_a_sync_mid_run_keeps_each_request_on_the_weights_it_started_with(
    load, new_weights, old_ref, new_ref
):
    live = load()
    inst = live.instance
    old = inst.weights_versions["transformer"]
    sched = Engine().scheduler(batching=False)  # bitwise: every step runs alone
    before = [ask(live, "a", 1), ask(live, "b", 2, "a blue square moving up"), ask(live, "c", 3)]
    with torch.no_grad():
        entries = {r.request_id: sched.submit(*live.job(r)) for r in before}
        for _ in range(4):  # encode, text K/V, two denoise steps
            sched.step()
        assert all(e.phase == "running" and e.active_loop.state.step == 2 for e in entries.values())
        text, kv = len(inst.feature_cache), len(inst.kv_cache)
        assert text == 2 and kv == 2  # two prompts: their embeddings and their transformer K/V

        staged = stage_sync(live, PLAN, new_weights)  # built while the requests wait: nothing live changed
        assert inst.weights_versions["transformer"] == old
        swap = sched.at_boundary(staged.apply)
        assert not swap.done()
        sched.step()  # the swap, then the tick
        result = swap.result(timeout=0)
        assert result.versions == {"transformer": "step-1"} and result.previous == {"transformer": old}
        assert result.pinned == ["a", "b", "c"] and result.tensors == {"transformer": len(new_weights)}
        assert result.cache_entries_dropped == kv and len(inst.kv_cache) == 0  # the transformer's K/V
        assert len(inst.feature_cache) == text  # the text encoder's embeddings stay
        assert inst.retired_versions == [("transformer", old)]  # still used by a, b, c

        after = [ask(live, "d", 1), ask(live, "e", 4, "a green square moving down")]
        entries.update({r.request_id: sched.submit(*live.job(r)) for r in after})
        while sched.has_work():
            sched.step()
    assert inst.retired_versions == []  # freed once a, b and c finished
    assert all(e.error is None for e in entries.values())
    for request in before:
        assert_same(entries[request.request_id].result, solo(old_ref, request))
    for request in after:
        assert_same(entries[request.request_id].result, solo(new_ref, request))
    assert not torch.equal(entries["a"].result.outputs["frames"], entries["d"].result.outputs["frames"])
    for request in before + after:
        version = live.artifact(request, entries[request.request_id].result, 0.0).provenance["weights_hash"]
        assert version["transformer"] == (old if request in before else "step-1")


def test_old_and_new_weights_never_share_a_batched_call(load, new_weights, old_ref, new_ref, monkeypatch):
    """Batched serving: two requests on the old weights batch together; one on the new never joins them."""
    calls: list[list[str]] = []  # the batch-key instances of each batched call
    batch = oom.run_batch  # batched calls run there (with the out-of-memory split)

    def spy(plans, profile, *mode):
        calls.append([p.batch_key.instance for p in plans])
        return batch(plans, profile, *mode)

    monkeypatch.setattr(oom, "run_batch", spy)
    live = load()
    sched = Engine().scheduler(batching=True)
    before, after = [ask(live, "a", 1), ask(live, "b", 2)], [ask(live, "d", 3)]
    with torch.no_grad():
        entries = [sched.submit(*live.job(r)) for r in before]
        for _ in range(3):
            sched.step()
        swap = sched.at_boundary(stage_sync(live, PLAN, new_weights).apply)
        sched.step()
        assert swap.result(timeout=0).pinned == ["a", "b"]
        entries += [sched.submit(*live.job(r)) for r in after]
        while sched.has_work():
            sched.step()
        live_calls = list(calls)
        together = Engine().run_batched([old_ref.job(r) for r in before])
    assert any(len(c) == 2 for c in live_calls), "the two requests on the old weights were never batched"
    assert max(len(c) for c in live_calls) == 2  # the third, on the new weights, never joined them
    for entry, ref in zip(entries, [*together, solo(new_ref, after[0])], strict=True):
        assert_same(entry.result, ref)


def test_a_sync_through_the_async_engine(load, new_weights, old_ref, new_ref):
    """The server's engine: ``sync_weights(..., engine=)`` from another thread waits for the boundary;
    requests submitted before run on the old weights, after on the new, none fails."""
    live = load()
    before = [ask(live, f"old{i}", i) for i in range(3)]
    after = [ask(live, f"new{i}", i) for i in range(2)]

    async def main():
        async with AsyncEngine(Engine(), batching=False) as aengine:
            rids = [await aengine.submit(*live.job(r)) for r in before]
            synced = await asyncio.to_thread(sync_weights, live, PLAN, new_weights, aengine)
            rids += [await aengine.submit(*live.job(r)) for r in after]
            return synced, [await aengine.result(rid) for rid in rids]

    with torch.no_grad():
        synced, results = asyncio.run(main())
    assert set(synced.pinned) <= {r.request_id for r in before}
    for request, result in zip(before + after, results, strict=True):
        assert_same(result, solo(old_ref if request in before else new_ref, request))
    assert live.instance.retired_versions == []


def test_a_bad_payload_changes_nothing(load, new_weights):
    live = load()
    inst = live.instance
    module, old = inst.component("transformer"), inst.weights_versions["transformer"]
    name = "blocks.0.attn1.to_q.weight"
    wrong_shape = {**new_weights, name: torch.zeros(3, 3)}
    with pytest.raises(WeightsError, match=rf"tensor 'transformer.{name}' has shape \(3, 3\); the live one"):
        sync_weights(live, PLAN, wrong_shape)
    with pytest.raises(WeightsError, match=rf"'transformer.{name}' is float64; the live one is float32"):
        sync_weights(live, PLAN, {name: new_weights[name].double()})
    with pytest.raises(WeightsError, match="'transformer.no.such' is not in the live component"):
        sync_weights(live, PLAN, {"no.such": torch.zeros(1)})
    with pytest.raises(WeightsError, match="NaN or infinite"):
        sync_weights(live, PLAN, {name: torch.full_like(new_weights[name], float("nan"))})
    with pytest.raises(ConfigError, match="no weights component 'tokenizer'"):
        sync_weights(live, PLAN.model_copy(update={"components": ["tokenizer"]}), {"w": torch.zeros(1)})
    with pytest.raises(ConfigError, match=f"version {old!r} of 'transformer' is already resident"):
        sync_weights(live, PLAN.model_copy(update={"version": old}), new_weights)
    with pytest.raises(ValueError, match="not a training role"):
        WeightSyncPlan(role="teacher's pet", components=["transformer"], version="v2")
    assert inst.component("transformer") is module and inst.weights_versions["transformer"] == old
    # an idle engine swaps at once; a partial payload replaces only the tensors it names
    result = sync_weights(live, PLAN, {name: new_weights[name]}, engine=Engine())
    assert result.tensors == {"transformer": 1} and result.pinned == []
    state = inst.component("transformer").state_dict()
    assert torch.equal(state[name], new_weights[name])
    assert torch.equal(state["blocks.0.attn1.to_k.weight"], module.state_dict()["blocks.0.attn1.to_k.weight"])
    assert inst.retired_versions == []  # nothing was running: the old module is gone at once
