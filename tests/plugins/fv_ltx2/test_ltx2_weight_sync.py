"""Hot weight sync on LTX-2: a transformer sync lands between two ticks while requests (a two-stage
program among them) are mid-run.

Requests admitted before it finish bit for bit as on the old weights alone, the program's refine
stage included; those after as on the new weights alone (references: fresh instances, the new
weights loaded with plain ``load_state_dict``), the refine stage on the new weights with the LoRA
merged into them. The text features survive a transformer-only sync.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import fv_core
from fv_core import ConfigError, WeightsError
from fv_core.runtime import Engine
from fv_core.training import WeightSyncPlan, sync_weights
from fv_core.training.sync import stage_sync

TINY = "ltx2-tiny"
PLAN = WeightSyncPlan(role="student", components=["transformer"], version="step-1")
GUIDANCE_OFF = dict(
    guidance_scale=1.0,
    audio_guidance_scale=1.0,
    stg_scale=0.0,
    audio_stg_scale=0.0,
    modality_scale=1.0,
    audio_modality_scale=1.0,
)


@pytest.fixture(scope="module")
def load(ltx_host, ltx_path):
    """A fresh LoadedModel of the tiny card, per call."""
    return lambda: fv_core.load(TINY, ltx_path, host=ltx_host)


@pytest.fixture(scope="module")
def new_weights(load):
    """Every floating tensor of the tiny transformer, moved by seeded noise."""
    live = load().instance.component("transformer").state_dict()
    gen = torch.Generator().manual_seed(0)
    return {
        k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in live.items() if v.is_floating_point()
    }


def ask(model, rid, seed, prompt="a cat playing piano", task=None, **params):
    """A cheap request: guidance off, three steps; ``task="t2av-two-stage"`` for the program."""
    args = {"prompt": prompt, "seed": seed, "num_inference_steps": 3, **GUIDANCE_OFF}
    return model.prepare({**args, **params}, task=task, request_id=rid)


def solo(model, request):
    with torch.no_grad():
        return Engine().run_one(*model.job(request))


def assert_same(result, ref):
    for name in ("frames", "audio"):
        assert torch.equal(result.outputs[name], ref.outputs[name]), name


def test_a_transformer_sync_mid_run_keeps_each_request_on_its_weights(load, new_weights):
    old_ref, new_ref = load(), load()
    new_ref.instance.component("transformer").load_state_dict(new_weights, strict=False)
    live = load()
    inst = live.instance
    old = inst.weights_versions["transformer"]
    two_stage = dict(task="t2av-two-stage", height=128, width=128)
    sched = Engine().scheduler(batching=False)  # bitwise: every step runs alone
    before = [ask(live, "a", 1), ask(live, "b", 2, "rain on a roof"), ask(live, "p", 3, **two_stage)]
    with torch.no_grad():
        entries = {r.request_id: sched.submit(*live.job(r)) for r in before}
        for _ in range(3):  # encode, the prompt keys/values, one denoise step
            sched.step()
        assert all(e.phase == "running" and e.active_loop.state.step == 1 for e in entries.values())
        text = len(inst.feature_cache)
        assert text == 2  # two prompts: their connector outputs

        staged = stage_sync(live, PLAN, new_weights)  # built while the requests wait: nothing live changed
        assert inst.weights_versions["transformer"] == old
        swap = sched.at_boundary(staged.apply)
        sched.step()  # the swap, then the tick
        result = swap.result(timeout=0)
        assert result.versions == {"transformer": "step-1"} and result.previous == {"transformer": old}
        assert result.pinned == ["a", "b", "p"] and result.tensors == {"transformer": len(new_weights)}
        # the old transformer's prompt keys/values (two prompts) go; the text features survive
        assert (
            result.cache_entries_dropped == 2 and len(inst.kv_cache) == 0 and len(inst.feature_cache) == text
        )
        assert inst.retired_versions == [("transformer", old)]  # still used by a, b, p

        after = [ask(live, "d", 1), ask(live, "e", 4, "a quiet room"), ask(live, "q", 3, **two_stage)]
        entries.update({r.request_id: sched.submit(*live.job(r)) for r in after})
        while sched.has_work():
            sched.step()
    assert all(e.error is None for e in entries.values())
    assert inst.retired_versions == []  # freed once a, b and p finished
    assert list(inst._refine) == ["step-1"]  # the LoRA merged into the old transformer went with it
    assert entries["d"].result.metrics["text_cache_hits"] == 1  # a's text, encoded before the sync
    for request in before:
        assert_same(entries[request.request_id].result, solo(old_ref, request))
    for request in after:
        assert_same(entries[request.request_id].result, solo(new_ref, request))
    assert not torch.equal(entries["a"].result.outputs["frames"], entries["d"].result.outputs["frames"])
    assert not torch.equal(entries["p"].result.outputs["frames"], entries["q"].result.outputs["frames"])
    for request in before + after:
        version = live.artifact(request, entries[request.request_id].result, 0.0).provenance["weights_hash"]
        assert version["transformer"] == (old if request in before else "step-1")


def test_a_refine_after_a_sync_runs_on_the_new_weights(load, new_weights):
    """Nothing running: the swap is immediate and the refine weights merged into the old transformer go."""
    new_ref = load()
    new_ref.instance.component("transformer").load_state_dict(new_weights, strict=False)
    live = load()
    request = ask(live, "r", 5, task="t2av-two-stage", height=128, width=128)
    solo(live, request)
    assert list(live.instance._refine) == [live.instance.weights_versions["transformer"]]
    sync_weights(live, PLAN, new_weights)
    assert live.instance._refine == {} and live.instance.retired_versions == []
    assert_same(solo(live, request), solo(new_ref, request))


def test_a_bad_sync_names_the_tensor_the_rule_and_the_fix(load, new_weights):
    live = load()
    inst = live.instance
    module, old = inst.component("transformer"), inst.weights_versions["transformer"]
    name = "proj_out.weight"
    with pytest.raises(
        WeightsError,
        match=rf"tensor 'transformer.{name}' has shape \(3, 3\); the live one has .* a sync keeps the "
        r"architecture. Fix: send weights of the served model's configuration",
    ):
        sync_weights(live, PLAN, {**new_weights, name: torch.zeros(3, 3)})
    with pytest.raises(ConfigError, match=r"no weights component 'refine_lora' to sync. Fix: name one of"):
        sync_weights(live, PLAN.model_copy(update={"components": ["refine_lora"]}), {"w": torch.zeros(1)})
    inst.parallel = SimpleNamespace(plan=SimpleNamespace(id="sp=2"))  # as fv_core.load(parallel=) sets it
    with pytest.raises(ConfigError, match=r"runs its steps on a parallel group \(sp=2\).*Fix: sync a model"):
        sync_weights(live, PLAN, new_weights)
    inst.parallel = None
    assert inst.component("transformer") is module and inst.weights_versions["transformer"] == old
