"""Rollout on the real Wan serving loop: a BehaviorRecord per request (its own rows), rollout == serve bit
for bit, records saved and reloaded exactly, recorded steps replayed bit for bit under the serve and
the train profile (the C2 gate primitive), re-noise draws reproducible from the recorded generator."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import fv_core
from fv_core import ConfigError, LoadedModel
from fv_core.loop import BehaviorRecord, Profile
from fv_core.loop.observers import same_bits
from fv_core.plugins import PluginHost
from fv_core.request import Request
from fv_core.runtime import Engine
from fv_core.training.records import load_records, records_equal, save_records
from fv_core.training.rollout import call_of, check_c2, replay_call, replay_step, rollout
from fv_wan import plugin
from fv_wan.cards import fastwan_1_3b
from fv_wan.folder import WanFolder
from fv_wan.model import WanModel
from fv_wan.tiny import tiny_weights
from tests.runtime.synthetic import DenoiseLoop, SyntheticModel

SIZE = dict(num_frames=5, height=32, width=48, num_inference_steps=3)
RAW = [
    dict(SIZE, prompt="a cat", seed=1),  # a and b: same shape and CFG mode, so their steps batch
    dict(SIZE, prompt="a dog in the snow", seed=2),
    dict(SIZE, prompt="a red fish", seed=3, cfg_mode="batched"),  # c: its own graph, runs alone
]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    return tiny_weights(tmp_path_factory.mktemp("wan") / "wan2.1-t2v-tiny")


@pytest.fixture(scope="module")
def model(tiny_path) -> LoadedModel:
    host = PluginHost(env={})
    host.add(plugin, "fv-wan")
    return fv_core.load("wan2.1-t2v-tiny", tiny_path, host=host.collect())


@pytest.fixture(scope="module")
def rolled(model):
    return rollout(model, [model.prepare(raw, request_id=rid) for raw, rid in zip(RAW, "abc", strict=True)])


def records(rolled) -> list[BehaviorRecord]:
    return [r.record for r in rolled]


def denoise(record: BehaviorRecord) -> list[int]:
    return [i for i, s in enumerate(record.steps) if s.kind == "diffusion_step"]


def test_rollout_is_serve_plus_capture_with_one_record_per_request(model, rolled):
    with torch.no_grad():
        served = Engine().run_batched([model.job(r.request) for r in rolled])
    for r, s in zip(rolled, served, strict=True):
        assert s is not None and s.behavior is None
        assert same_bits(r.result.outputs["frames"], s.outputs["frames"])
        assert same_bits(r.result.outputs["latents"], s.outputs["latents"])
    a, b, c = records(rolled)
    for rec, r in zip((a, b, c), rolled, strict=True):
        p = r.request.params
        assert (rec.request_id, rec.loop_id, rec.seed) == (r.request.request_id, "t2v", p.seed)
        assert [rec.steps[i].label for i in denoise(rec)] == ["denoise 1/3", "denoise 2/3", "denoise 3/3"]
        assert [rec.steps[i].step for i in denoise(rec)] == [0, 1, 2]
        assert rec.schedule["timesteps"].shape == (3,) and rec.schedule["sigmas"].shape == (4,)
        assert rec.guidance == {"transformer": p.guidance_scale}
        assert rec.weights_versions == dict(model.instance.weights_versions) and rec.weights_versions
        assert rec.conditioning["text"].shape[0] == 1 and rec.conditioning["neg_text"].shape[0] == 1
        first = rec.steps[denoise(rec)[0]].inputs["latents"]
        # the request's own rows: its seed's initial noise, not another request's
        noise = torch.randn((1, *first.shape[1:]), generator=torch.Generator().manual_seed(p.seed))
        assert same_bits(first[:1], noise)
        kv = [rec.steps[i].inputs["kv"] for i in denoise(rec)]
        assert all(x is kv[0] for x in kv)  # the step-invariant text K/V is held once
    # a and b ran each denoise step in one batched call; each record holds its own row only
    for i, j in zip(denoise(a), denoise(b), strict=True):
        sa, sb = a.steps[i], b.steps[j]
        assert sa.call == sb.call and (sa.position, sb.position) == (0, 1) and sa.batched_with == 2
        assert sa.inputs["latents"].shape[0] == 1 and sa.outputs["cond"].shape[0] == 1
    for i in denoise(c):  # batched CFG: c's two rows [cond, uncond], alone
        assert c.steps[i].batched_with == 1 and c.steps[i].inputs["latents"].shape[0] == 2
        assert c.steps[i].outputs["velocity"].shape[0] == 2 and c.steps[i].replayable


def test_every_recorded_step_replays_bit_for_bit(model, rolled):
    recs = records(rolled)
    for rec in recs:
        for i, step in enumerate(rec.steps):
            members = call_of(recs, rec, i)
            assert len(members) == step.batched_with
            outs = replay_call(model, members)
            for (r, k), out in zip(members, outs, strict=True):
                assert out.keys() == r.steps[k].outputs.keys()
                assert all(same_bits(out[n], v) for n, v in r.steps[k].outputs.items()), r.steps[k].label


def test_replay_under_serve_and_train_profiles_reproduces_the_prediction(model, rolled):
    _, _, c = records(rolled)
    for i in denoise(c):
        served = replay_step(model, c, i, Profile.SERVE)
        trained = replay_step(model, c, i, Profile.TRAIN)
        assert same_bits(served["velocity"], c.steps[i].outputs["velocity"])
        assert same_bits(trained["velocity"].detach(), c.steps[i].outputs["velocity"])
        assert served["velocity"].grad_fn is None and trained["velocity"].grad_fn is not None
        assert check_c2(model, c, i, ["velocity"])["velocity"].requires_grad
    # the replay would notice a wrong input: the next step's timestep changes the prediction
    i, j = denoise(c)[:2]
    wrong = dataclasses.replace(
        c.steps[i], inputs={**c.steps[i].inputs, "timestep": c.steps[j].inputs["timestep"]}
    )
    bad = dataclasses.replace(c, steps=[wrong if k == i else s for k, s in enumerate(c.steps)])
    assert not same_bits(replay_step(model, bad, i)["velocity"], c.steps[i].outputs["velocity"])


def test_records_save_and_load_exactly(model, rolled, tmp_path: Path):
    recs = records(rolled)
    save_records(tmp_path / "records", recs)
    back = load_records(tmp_path / "records")
    assert len(back) == len(recs) and all(records_equal(x, y) for x, y in zip(recs, back, strict=True))
    assert all(isinstance(s.rng, torch.Tensor) for r in back for s in r.steps)
    kv = [back[0].steps[i].inputs["kv"] for i in denoise(back[0])]
    assert all(x is kv[0] for x in kv)  # still one tensor after the round trip
    # replaying the reloaded records reproduces the rollout's predictions
    a = back[0]
    for i in denoise(a):
        out = replay_call(model, call_of(back, a, i))[0]
        assert same_bits(out["cond"], recs[0].steps[i].outputs["cond"])
    # the comparison can fail: one flipped sign bit, one changed field
    d = denoise(a)[0]
    flipped = a.steps[d].inputs["latents"].clone()
    flipped.view(-1)[0] = -flipped.view(-1)[0]
    step = dataclasses.replace(a.steps[d], inputs={**a.steps[d].inputs, "latents": flipped})
    assert not records_equal(
        a, dataclasses.replace(a, steps=[step if k == d else s for k, s in enumerate(a.steps)])
    )
    assert not records_equal(a, dataclasses.replace(a, guidance={"transformer": 4.0}))


def test_recorded_generator_state_reproduces_the_re_noise(tiny_path):
    instance = WanModel(WanFolder.bind(fastwan_1_3b(), Path(tiny_path)), tiny_path)
    fast = LoadedModel(instance.card, instance, tiny_path, source=instance.card.model_id)
    [ro] = rollout(fast, [dict(prompt="a bird", seed=5, num_frames=5, height=32, width=48)])
    rec, sigmas = ro.record, ro.record.schedule["sigmas"]
    steps = [rec.steps[i] for i in denoise(rec)]
    assert len(steps) == 3 and steps[0].rng is not steps[1].rng  # the DMD sampler drew between steps
    for s, n in zip(steps, steps[1:], strict=False):
        x0 = s.inputs["latents"] - sigmas[s.step] * s.outputs["velocity"]
        noise = torch.randn(x0.shape, generator=torch.Generator().set_state(s.rng))
        renoised = (1 - sigmas[s.step + 1]) * x0 + sigmas[s.step + 1] * noise
        assert same_bits(renoised, n.inputs["latents"])


def test_replay_refuses_hashes_loops_without_replay_plan_and_partial_calls(model, rolled, tmp_path):
    [ro] = rollout(model, [dict(SIZE, prompt="a cat", seed=1, num_inference_steps=2)], refs=True)
    assert ro.record.refs and isinstance(ro.record.steps[-1].inputs["latents"], str)
    with pytest.raises(ConfigError, match="content hashes"):
        replay_step(model, ro.record, len(ro.record.steps) - 1)
    save_records(tmp_path / "refs", [ro.record])
    assert records_equal(load_records(tmp_path / "refs")[0], ro.record)

    synthetic = SyntheticModel(seed=0)
    loop = DenoiseLoop(synthetic)
    rec = Engine(profile=Profile.ROLLOUT).run_one(loop, Request("s", params={"steps": 2}), synthetic).behavior
    with pytest.raises(ConfigError, match="no replay_plan"):
        replay_step(loop, rec, 0)

    a = records(rolled)[0]
    with pytest.raises(ConfigError, match="hold 1 of them"):
        call_of([a], a, denoise(a)[0])


def test_ltx2_rollout_records_and_replays_its_branch_calls(tmp_path_factory):
    from fv_ltx2 import plugin as ltx2_plugin
    from fv_ltx2.tiny import TINY_ID
    from fv_ltx2.tiny import tiny_weights as ltx2_weights

    host = PluginHost(env={})
    host.add(ltx2_plugin, "fv-ltx2")
    ltx = fv_core.load(TINY_ID, ltx2_weights(tmp_path_factory.mktemp("ltx2") / "tiny"), host=host.collect())
    raw = dict(prompt="a cat", num_inference_steps=2)  # the fewest it runs
    rolled = rollout(ltx, [dict(raw, seed=1), dict(raw, seed=2, prompt="a dog")])
    with torch.no_grad():
        served = Engine().run_batched([ltx.job(r.request) for r in rolled])
    recs = [r.record for r in rolled]
    for r, s, rec in zip(rolled, served, recs, strict=True):
        assert s is not None and same_bits(r.result.outputs["frames"], s.outputs["frames"])
        assert rec.guidance["video"][0] == r.request.params.guidance_scale
        assert (
            rec.weights_versions == dict(ltx.instance.weights_versions) and "video_text" in rec.conditioning
        )
        labels = [s.label for s in rec.steps if s.kind == "diffusion_step"]
        # the tiny transformer has no perturbed attention: STG's call is the cond call, and is not made
        assert labels == [f"denoise {i}/2 ({b})" for i in (1, 2) for b in ("cfg", "modality")]
    a = recs[0]
    for i in denoise(a)[:2]:  # the first step's cfg and modality calls
        members = call_of(recs, a, i)
        assert [r.request_id for r, _ in members] == [recs[0].request_id, recs[1].request_id]
        for (r, k), out in zip(members, replay_call(ltx, members), strict=True):
            assert all(same_bits(out[n], v) for n, v in r.steps[k].outputs.items()), r.steps[k].label
        check_c2(ltx, a, i, ["video", "audio"])  # alone, serve == train bit for bit
