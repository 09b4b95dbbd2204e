"""The self_forcing method: its spec, what trains and what stays frozen, the EMA, the exit-step gradient,
resume, export, option errors and the C2 gate against the causal serve loop."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from sf_support import sf_config

import fv_core
from fv_core import ConfigError
from fv_core.loop import Done, Profile, WorkUnitKind, run_plan
from fv_core.plugins import PluginHost
from fv_core.training import Consistency, Role, train, train_adapter, validate
from fv_train_self_forcing import plugin
from fv_train_self_forcing.config import SelfForcingOptions
from fv_train_self_forcing.method import SelfForcingMethod

REPO = Path(__file__).resolve().parents[3]


def test_method_and_options_are_registered_with_their_spec():
    host = PluginHost({})
    host.add(plugin, "fv-train-self-forcing")
    host.collect()
    assert host.infos["fv-train-self-forcing"].hooks == ["fv_register_methods", "fv_register_options"]
    assert host.registries.methods.get("self_forcing") is SelfForcingMethod
    assert host.registries.options.get("fv-train-self-forcing") is SelfForcingOptions
    described = SelfForcingMethod.spec.describe()
    assert described["consistency"] == Consistency.C2_FREE.value
    assert described["roles"] == {
        "student": {"holds": ["transformer"], "trains": ["transformer"]},
        "ema": {"holds": ["transformer"], "trains": []},
        "teacher": {"holds": ["transformer", "text_encoder"], "trains": []},
        "critic": {"holds": ["transformer"], "trains": ["transformer"]},
    }
    assert "steps.inputs" in described["record_fields"] and "chunks" in described["record_fields"]


def _moved(before: list[torch.Tensor], module: torch.nn.Module) -> bool:
    return any(not torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))


def test_losses_are_finite_and_move_student_critic_and_ema_train_teacher_stays(trained):
    method, before, out = trained
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    steps = [r for r in log if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for record in steps:
        assert all(math.isfinite(v) for v in record.values()), record
    assert all("loss_dm" in r for r in steps)  # generator updates at steps 0 and 2
    # the first: critic == teacher, so fake == real and no gradient; the second: the critic has moved
    assert steps[0]["dm_grad"] == 0 and steps[2]["dm_grad"] > 0 and steps[2]["loss_dm"] > 0
    assert len({r["loss_critic"] for r in steps}) == 4  # the critic's loss changes step to step
    for role, changed in ((Role.STUDENT, True), (Role.EMA, True), (Role.CRITIC, True), (Role.TEACHER, False)):
        assert _moved(before[role], method.roles[role]["transformer"]) is changed, role
    assert not any(p.requires_grad for p in method.teacher.parameters())
    assert not any(p.requires_grad for p in method.ema.parameters())
    # the EMA (decay 0.5, two updates) lies between where the student started and where it is
    assert _moved([p.detach() for p in method.student.parameters()], method.ema)


def test_ema_update_is_the_exponential_moving_average(trained):
    method = trained[0]
    saved = {k: v.clone() for k, v in method.ema.state_dict().items()}
    ema = [p.detach().clone() for p in method.ema.parameters()]
    student = [p.detach().clone() for p in method.student.parameters()]
    assert any(not torch.equal(e, s) for e, s in zip(ema, student, strict=True))
    method.update_ema(0.75)
    for e0, s, e in zip(ema, student, method.ema.parameters(), strict=True):
        torch.testing.assert_close(e, 0.75 * e0 + 0.25 * s, rtol=0, atol=1e-6)
    method.update_ema(0.0)  # before ema_start: a copy
    for s, e in zip(student, method.ema.parameters(), strict=True):
        assert torch.equal(e, s)
    method.ema.load_state_dict(saved)  # the fixture's EMA for the tests after this one


def test_only_each_chunks_exit_step_carries_the_gradient(trained, monkeypatch):
    """A rollout with exits [1, 0, 3]: chunk passes in the loop's order (2, 1 and 4 denoise steps, a cache
    write after each chunk but the last), grad enabled in exactly the three exit passes; the video's
    gradient reaches the student's weights."""
    import fv_wan.training

    method = trained[0]
    grads: list[bool] = []
    body = fv_wan.training.chunk_body

    def recording(transformer, inputs):
        grads.append(torch.is_grad_enabled())
        return body(transformer, inputs)

    monkeypatch.setattr(fv_wan.training, "chunk_body", recording)
    gen = torch.Generator().manual_seed(0)
    noise = method.adapter.noise(2, gen, num_frames=9)
    video = method.rollout(method.student, method.embeds[:2], noise, gen, [1, 0, 3], grad=True)
    assert grads == [False, True, False, True, False, False, False, False, True]
    assert video.shape == noise.shape and video.requires_grad
    method.student.zero_grad(set_to_none=True)
    video.square().mean().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in method.student.parameters())
    method.student.zero_grad(set_to_none=True)


def test_regression_is_teacher_forced_and_pulls_the_student_to_the_teachers_samples(trained, monkeypatch):
    """regression_loss: one pass with grad per chunk and, after each chunk but the last, a cache write of
    the teacher's own clean chunk (no grad); a few optimiser steps on it alone lower it at the same draws;
    the teacher gets no gradient."""
    import fv_wan.training

    method = trained[0]
    saved = {k: v.clone() for k, v in method.student.state_dict().items()}
    passes: list[tuple[bool, torch.Tensor]] = []
    body = fv_wan.training.chunk_body

    def recording(transformer, inputs):
        passes.append((torch.is_grad_enabled(), inputs["latents"]))
        return body(transformer, inputs)

    monkeypatch.setattr(fv_wan.training, "chunk_body", recording)
    embeds = method.embeds[:2]
    first = method.regression_loss(embeds, torch.Generator().manual_seed(0))
    assert [grad for grad, _ in passes] == [True, False, True, False, True]
    gen = torch.Generator().manual_seed(0)
    target = method.teacher_sample(method.adapter.noise(2, gen, num_frames=9), embeds)
    for chunk, (_, latents) in enumerate(passes[1::2]):  # context timestep 0: the clean chunk itself
        assert torch.equal(latents, target[:, :, chunk : chunk + 1].to(latents.dtype)), chunk
    optimiser = torch.optim.Adam(method.student.parameters(), lr=1e-3)
    for _ in range(5):
        optimiser.zero_grad(set_to_none=True)
        method.regression_loss(embeds, torch.Generator().manual_seed(0)).backward()
        optimiser.step()
    after = method.regression_loss(embeds, torch.Generator().manual_seed(0))
    assert after.item() < 0.9 * first.item()
    assert all(p.grad is None for p in method.teacher.parameters())
    method.student.load_state_dict(saved)  # the fixture's student for the tests after this one
    method.student.zero_grad(set_to_none=True)


def test_a_regression_weight_adds_the_logged_regression_loss(prompts, tmp_path):
    method = SelfForcingMethod(validate(sf_config(tmp_path, prompts, steps=1, regression_weight=2.0)))
    train(method.cfg, method, progress=False)
    record = json.loads((tmp_path / "log.jsonl").read_text().splitlines()[0])
    assert record["step"] == 1 and record["loss_regression"] > 0 and math.isfinite(record["loss_regression"])
    assert json.loads((tmp_path / "final" / "fv_recipe.json").read_text())["regression_weight"] == 2.0


def test_export_is_a_loadable_causal_student_with_its_recipe(trained):
    method, _, out = trained
    recipe = json.loads((out / "final" / "fv_recipe.json").read_text())
    assert recipe["method"] == "self_forcing" and recipe["parents"] == ["wan2.1-t2v-tiny"]
    assert recipe["loop"] == "causal" and recipe["timesteps"] == [1000, 750, 500, 250]
    assert recipe["chunk_frames"] == 1 and recipe["exported"] == "ema" and recipe["train_steps"] == 4
    assert recipe["steps_done"] == 4
    assert json.loads((out / "checkpoint-2" / "fv_recipe.json").read_text())["steps_done"] == 2
    causal = fv_core.load("wan2.1-t2v-tiny-causal", out / "final")
    for a, b in zip(
        causal.instance.component("transformer").parameters(), method.ema.parameters(), strict=True
    ):
        assert torch.equal(a, b)
    video = causal.generate(prompt="a red circle moving left", seed=0)
    assert video.frames.shape[0] == 9


def test_resume_from_a_checkpoint_equals_the_uninterrupted_run(trained, prompts, tmp_path):
    method, _, out = trained
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    run = tmp_path / "run"
    shutil.copytree(out, run, ignore=shutil.ignore_patterns("checkpoint-4", "final"))
    resumed = SelfForcingMethod(validate(sf_config(run, prompts, steps=4)))
    assert train(resumed.cfg, resumed, progress=False)["resumed_from"] == 2
    for role in (Role.STUDENT, Role.EMA, Role.CRITIC):
        a_params = method.roles[role]["transformer"].parameters()
        b_params = resumed.roles[role]["transformer"].parameters()
        for a, b in zip(a_params, b_params, strict=True):
            assert torch.equal(a, b), role


@pytest.mark.parametrize(
    "options,match",
    [
        ({"timesteps": [250, 1000]}, r"timesteps=\[250, 1000\] must be strictly decreasing.*Fix"),
        (
            {"window_frames": 1},
            r"window_frames=1 cannot hold sink_frames=1 plus a chunk.*Fix: window_frames >= 2",
        ),
        ({"min_sigma": 0.9, "max_sigma": 0.5}, r"min_sigma=0.9 must be below max_sigma=0.5.*Fix"),
        ({"ema_decay": 1.0}, r"ema_decay.*less than 1.*Fix"),
        ({"regression_weight": -1}, r"regression_weight.*greater than or equal to 0.*Fix"),
        ({"chunk_frames": 2}, r"num_frames=9 makes 3 latent frames, not a multiple of chunk_frames=2.*Fix"),
        ({"bogus": 1}, r"bogus: Extra inputs are not permitted; got 1. Fix: it is an unknown field"),
        ({"prompts": "/nonexistent/prompts.txt"}, r"options.prompts='/nonexistent/prompts.txt'.*Fix"),
    ],
)
def test_bad_options_name_the_value_the_rule_and_the_fix(options, match, prompts, tmp_path):
    config = sf_config(tmp_path, prompts, steps=1)
    config["options"].update(options)
    with pytest.raises(ConfigError, match=match):
        SelfForcingMethod(validate(config))


def test_c2_the_training_rollout_is_the_causal_serve_loop_bit_for_bit(prompts, tmp_path, monkeypatch):
    """C2 gate: the causal card's serve loop (21 frames = 6 chunks of 4 tokens, a window of 4 frames keeping 1 sink, so
    a context padded to a power of two and a rolled window both occur) run step by step under the serve
    profile; the method's rollout of the same prompt, noise and generator with every chunk's exit at the
    last step and grad on gives every chunk pass (denoise steps and cache writes) and the video exactly."""
    import fv_wan.training

    card, prompt, seed = "wan2.1-t2v-tiny-causal", "a blue square moving up", 3
    request = {"prompt": prompt, "seed": seed, "num_frames": 21, "window_frames": 4, "sink_frames": 1}
    served_model = fv_core.load(card)
    options = {"num_frames": 21, "window_frames": 4, "sink_frames": 1}
    method = SelfForcingMethod(validate(sf_config(tmp_path, prompts, steps=1, **options)))
    # the served weights themselves (a copy in other memory can round differently in CPU matmuls)
    method.adapter = train_adapter(served_model)
    method.roles[Role.STUDENT]["transformer"] = served_model.instance.component("transformer")
    method.student.requires_grad_(True)

    loop, req, instance = served_model.job(served_model.prepare(request))
    state = loop.init(req, instance)
    served: list[dict[str, torch.Tensor]] = []
    while not isinstance(plan := loop.next(state), Done):
        result = run_plan(plan, Profile.SERVE)
        if plan.kind in (WorkUnitKind.DIFFUSION_STEP, WorkUnitKind.AR_PREFILL):
            served.append({"velocity": result.outputs["velocity"], "ctx": plan.inputs["ctx_valid"]})
        state = loop.advance(state, result)
    served_latents = state.tensors["latents"]
    assert max(len(s["ctx"][0]) for s in served) == 4 * 4 and state.values["evicted"] == [1]
    assert any(not bool(s["ctx"].all()) for s in served)  # a padded context was served

    trained_passes: list[dict[str, torch.Tensor]] = []
    body = fv_wan.training.chunk_body

    def recording(transformer, inputs):
        out = body(transformer, inputs)
        trained_passes.append(
            {"velocity": out["velocity"], "ctx": inputs["ctx_valid"], "grad": out["velocity"].requires_grad}
        )
        return out

    monkeypatch.setattr(fv_wan.training, "chunk_body", recording)
    gen = torch.Generator().manual_seed(seed)  # the loop's request generator: noise first, then re-noise
    noise = method.adapter.noise(1, gen, num_frames=21)
    embeds = method.adapter.conditioning([prompt])
    video = method.rollout(method.student, embeds, noise, gen, [3] * 6, grad=True)
    assert len(trained_passes) == len(served) == 6 * 4 + 5
    assert sum(p["grad"] for p in trained_passes) == 6  # every chunk's exit pass ran under the train profile
    for i, (mine, theirs) in enumerate(zip(trained_passes, served, strict=True)):
        assert torch.equal(mine["ctx"], theirs["ctx"]), i
        assert torch.equal(mine["velocity"].detach(), theirs["velocity"]), i
    assert video.requires_grad and torch.equal(video.detach(), served_latents)


@pytest.mark.parametrize(
    "name",
    ["self_forcing.yaml", "self_forcing_stage2.yaml", "self_forcing_stage3.yaml", "self_forcing_stage4.yaml"],
)
def test_the_shapes_configs_train_for_the_shapes_causal_cards_loop(name):
    """configs/shapes/self_forcing*.yaml roll out with the chunking, schedule and window the
    wan2.1-t2v-shapes-causal card serves with."""
    from fv_wan.cards import wan_shapes_causal

    card = wan_shapes_causal()
    config = yaml.safe_load((REPO / "configs/shapes" / name).read_text())
    opts = SelfForcingOptions.model_validate(config["options"])
    defaults = card.programs["t2v"].defaults
    assert config["method"] == "self_forcing" and opts.teacher == "wan2.1-t2v-shapes"
    assert opts.timesteps == card.loops["causal"].steps.fixed_timesteps
    for field in ("flow_shift", "chunk_frames", "context_timestep", "window_frames", "sink_frames"):
        assert getattr(opts, field) == defaults[field], field
    assert (opts.num_frames or 9) == defaults["num_frames"]
    assert card.recipe.method == "self_forcing" and card.recipe.parents == ["wan2.1-t2v-shapes"]


def test_a_family_without_causal_pieces_is_refused_by_name(prompts, tmp_path, monkeypatch):
    """A teacher whose family's training adapter offers no causal loop pieces: the error names the family,
    the missing pieces and the fix."""
    import fv_train_self_forcing.method as method_module

    class Bidirectional:  # a TrainAdapter without causal_schedule / text_kv / chunk_context / chunk_velocity
        def __init__(self, model):
            self.model = model

    monkeypatch.setattr(method_module, "train_adapter", Bidirectional)
    with pytest.raises(
        ConfigError, match=r"family 'wan' lacks the causal loop pieces \['causal_schedule'.*Fix"
    ):
        SelfForcingMethod(validate(sf_config(tmp_path, prompts, steps=1)))
