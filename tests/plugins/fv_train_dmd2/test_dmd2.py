"""The dmd2 method: what trains and what stays frozen, resume, export, option errors, the C2 gate."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from dmd2_support import dmd2_config

import fv_core
from fv_core import ConfigError
from fv_core.loop import Done, Profile, WorkUnitKind, run_plan
from fv_core.plugins import PluginHost
from fv_core.training import Consistency, Role, check_c2, rollout, train, train_adapter, validate
from fv_core.training.dmd import GAN_HEAD_FILE
from fv_train_dmd2 import plugin
from fv_train_dmd2.config import DMD2Options
from fv_train_dmd2.method import DMD2Method


def test_method_and_options_are_registered():
    host = PluginHost({})
    host.add(plugin, "fv-train-dmd2")
    host.collect()
    assert host.infos["fv-train-dmd2"].hooks == ["fv_register_methods", "fv_register_options"]
    assert host.registries.methods.get("dmd2") is DMD2Method
    assert host.registries.options.get("fv-train-dmd2") is DMD2Options
    spec = DMD2Method.spec
    assert spec.consistency is Consistency.C2_FREE
    assert spec.role(Role.STUDENT).trains == ("transformer",) and spec.role(Role.CRITIC).trains == (
        "transformer",
    )
    assert spec.role(Role.TEACHER).trains == ()


def test_losses_are_finite_student_and_critic_train_teacher_stays(trained):
    method, before, out = trained
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    steps = [r for r in log if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for record in steps:
        assert all(math.isfinite(v) for v in record.values()), record
    assert all("loss_dm" in r for r in steps)  # the generator updated at step 0 (and 2)
    for role, changed in ((Role.STUDENT, True), (Role.CRITIC, True), (Role.TEACHER, False)):
        now = list(method.roles[role]["transformer"].parameters())
        moved = any(not torch.equal(a, b) for a, b in zip(before[role], now, strict=True))
        assert moved is changed, role
    assert not any(p.requires_grad for p in method.teacher.parameters())


def test_export_is_a_loadable_student_with_its_recipe(trained):
    method, _, out = trained
    recipe = json.loads((out / "final" / "fv_recipe.json").read_text())
    assert recipe["method"] == "dmd2" and recipe["parents"] == ["wan2.1-t2v-tiny"]
    assert recipe["teacher"]["card"] == "wan2.1-t2v-tiny" and recipe["teacher"]["steps"] == 4
    assert recipe["steps"] == 2 and recipe["timesteps"] == [1000, 750] and recipe["sampler"] == "dmd"
    exported = fv_core.load("wan2.1-t2v-tiny", out / "final").instance.component("transformer")
    for a, b in zip(exported.parameters(), method.student.parameters(), strict=True):
        assert torch.equal(a, b)


def test_resume_from_a_checkpoint_equals_the_uninterrupted_run(trained, prompts, tmp_path):
    method, _, out = trained
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    run = tmp_path / "run"
    shutil.copytree(out, run, ignore=shutil.ignore_patterns("checkpoint-4", "final"))
    resumed = DMD2Method(validate(dmd2_config(run, prompts, steps=4)))
    resumed.load(run / "checkpoint-2")
    assert resumed.steps_done == 2  # an export right after resuming names the steps trained
    assert train(resumed.cfg, resumed, progress=False)["resumed_from"] == 2
    for role in (Role.STUDENT, Role.CRITIC):
        a_params = method.roles[role]["transformer"].parameters()
        b_params = resumed.roles[role]["transformer"].parameters()
        for a, b in zip(a_params, b_params, strict=True):
            assert torch.equal(a, b), role
    log = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if "loss" in r] == [1, 2, 3, 4]


@pytest.mark.parametrize(
    "options,match",
    [
        ({"timesteps": [750, 1000]}, r"timesteps.*strictly decreasing.*\[750, 1000\].*Fix"),
        ({"timesteps": []}, r"timesteps.*at least 1"),
        (
            {"critic_steps_per_generator": 0},
            r"critic_steps_per_generator.*greater than or equal to 1.*got 0.*Fix",
        ),
        ({"min_sigma": 0.9, "max_sigma": 0.5}, r"min_sigma=0.9 must be below max_sigma=0.5.*Fix"),
        ({"real_guidance": 0.5}, r"real_guidance.*greater than or equal to 1.*Fix"),
        ({"critic_lr": -1}, r"critic_lr.*greater than 0.*Fix"),
        ({"bogus": 1}, r"bogus: Extra inputs are not permitted; got 1. Fix: it is an unknown field"),
        ({"prompts": "/nonexistent/prompts.txt"}, r"options.prompts='/nonexistent/prompts.txt'.*Fix"),
    ],
)
def test_bad_options_name_the_value_the_rule_and_the_fix(options, match, prompts, tmp_path):
    config = dmd2_config(tmp_path, prompts, steps=1)
    config["options"].update(options)
    with pytest.raises(ConfigError, match=match):
        DMD2Method(validate(config))


def test_regression_pulls_a_one_step_student_to_the_teachers_sample_of_its_noise(prompts, tmp_path):
    """DMD's regression loss: at one step the student's input is the very noise the teacher's ODE sample
    came from; a few optimiser steps on it alone lower it at the same draws; a run logs it."""
    config = dmd2_config(tmp_path, prompts, steps=1, timesteps=[1000], regression_weight=1.0)
    method = DMD2Method(validate(config))
    embeds = method.embeds[:2]
    first = method.regression_loss(embeds, torch.Generator().manual_seed(0)).item()
    gen = torch.Generator().manual_seed(0)
    noise = method.adapter.noise(2, gen)
    target = method.teacher_sample(noise, embeds)
    with torch.no_grad():
        direct = torch.nn.functional.mse_loss(method.student_x0(noise, 0, embeds, train=False), target)
    assert direct.item() == pytest.approx(first, rel=1e-6)
    optimiser = torch.optim.Adam(method.student.parameters(), lr=1e-3)
    for _ in range(5):
        optimiser.zero_grad(set_to_none=True)
        method.regression_loss(embeds, torch.Generator().manual_seed(0)).backward()
        optimiser.step()
    assert method.regression_loss(embeds, torch.Generator().manual_seed(0)).item() < 0.9 * first
    assert all(p.grad is None for p in method.teacher.parameters())
    train(method.cfg, method, progress=False)
    record = json.loads((tmp_path / "log.jsonl").read_text().splitlines()[0])
    assert record["loss_regression"] > 0 and math.isfinite(record["loss_regression"])


GAN = {
    "teacher": "wan2.1-t2v-shapes",
    "gan_data": "shapes",
    "gan_generator_weight": 0.5,
    "gan_critic_weight": 1.0,
    "gan_head_lr_scale": 10.0,
    "gan_max_sigma": 0.5,
}


def test_the_gan_term_trains_its_head_on_real_clips_and_resumes(prompts, tmp_path):
    """DMD2's GAN term on the shapes teacher (fv-train-flow's ``shapes`` clips are its size): the critic's
    GAN loss and logits are logged every step, the student's GAN loss on its updates; the head trains;
    the student's samples get a gradient from it; a resumed run equals the uninterrupted one."""
    out = tmp_path / "run"
    method = DMD2Method(validate(dmd2_config(out, prompts, steps=4, **GAN)))
    assert method.gan_head is not None
    head = [p.detach().clone() for p in method.gan_head.parameters()]
    train(method.cfg, method, progress=False)
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    steps = [r for r in log if "loss" in r]
    for record in steps:
        assert all(math.isfinite(v) for v in record.values()), record
        assert record["loss_gan_critic"] > 0 and {"gan_real_logit", "gan_fake_logit"} <= record.keys()
    assert all(r["loss_gan"] > 0 for r in steps)  # from the first generator update on (steps 0 and 2)
    assert any(not torch.equal(a, b) for a, b in zip(head, method.gan_head.parameters(), strict=True))
    critic_group, head_group = method.opt_c.param_groups
    assert head_group["lr"] == 10.0 * critic_group["lr"] > 0
    sigmas: list[torch.Tensor] = []
    features = method.adapter.features

    def recording(transformer, latents, sigma, embeds, train=False):
        sigmas.append(sigma)
        return features(transformer, latents, sigma, embeds, train)

    method.adapter.features = recording
    x0 = method.adapter.noise(64, torch.Generator().manual_seed(1)).requires_grad_(True)
    method.discriminate(
        x0, method.embeds[:1].expand(64, -1, -1), torch.Generator().manual_seed(2)
    ).sum().backward()
    method.adapter.features = features
    assert x0.grad is not None and x0.grad.abs().sum() > 0
    assert 0.02 <= sigmas[0].min() and sigmas[0].max() <= 0.75  # gan_max_sigma 0.5 under shift 3
    recipe = json.loads((out / "final" / "fv_recipe.json").read_text())
    assert (
        recipe["gan_loss"] is True and recipe["gan_data"] == "shapes" and recipe["student_init"] == "teacher"
    )

    resumed_run = tmp_path / "resumed"
    shutil.copytree(out, resumed_run, ignore=shutil.ignore_patterns("checkpoint-4", "final"))
    resumed = DMD2Method(validate(dmd2_config(resumed_run, prompts, steps=4, **GAN)))
    assert train(resumed.cfg, resumed, progress=False)["resumed_from"] == 2
    pairs = [(method.gan_head, resumed.gan_head), (method.student, resumed.student)]
    for a, b in pairs + [(method.critic, resumed.critic)]:
        for p, q in zip(a.parameters(), b.parameters(), strict=True):
            assert torch.equal(p, q)

    headless = tmp_path / "headless"  # a checkpoint saved without the GAN term, resumed with it on
    shutil.copytree(out, headless, ignore=shutil.ignore_patterns("checkpoint-4", "final"))
    (headless / "checkpoint-2" / GAN_HEAD_FILE).unlink()
    again = DMD2Method(validate(dmd2_config(headless, prompts, steps=4, **GAN)))
    with pytest.raises(ConfigError, match=r"checkpoint .*checkpoint-2 has no GAN head .*Fix: resume with"):
        train(again.cfg, again, progress=False)


@pytest.mark.parametrize(
    "options,match",
    [
        ({"gan_data": "shapes"}, r"gan_data='shapes' with gan_generator_weight=0.0.*needs both.*Fix"),
        ({"gan_critic_weight": 1.0}, r"gan_data=None with .*gan_critic_weight=1.0.*Fix"),
        (
            {"gan_data": "shapes", "gan_generator_weight": 1.0},
            r"gan_generator_weight=1.0 with gan_critic_weight=0: .*Fix: set gan_critic_weight above 0",
        ),
        ({"gan_max_sigma": 0.01}, r"gan_max_sigma=0.01 must be above min_sigma=0.02.*Fix"),
        (
            {"detail_fraction": 0.5, "detail_max_sigma": 0.01},
            r"detail_max_sigma=0.01 must be above min_sigma=0.02.*Fix",
        ),
        (
            {"gan_data": "shapes", "gan_critic_weight": 1.0},  # the tiny teacher samples 5 frames of 32x32
            r"gan_data='shapes' gives clips of latent shape \[1, 16, 3, 8, 8\], the student samples "
            r"\[1, 16, 2, 4, 4\]. Fix",
        ),
    ],
)
def test_bad_gan_options_are_refused(options, match, prompts, tmp_path):
    with pytest.raises(ConfigError, match=match):
        DMD2Method(validate(dmd2_config(tmp_path, prompts, steps=1, **options)))


def test_detail_fraction_draws_that_share_of_levels_low(prompts, tmp_path):
    """Under shift 3 about a tenth of the levels (0.11) fall at or below 0.3; with detail_fraction 0.5 half
    of them are redrawn uniformly in [min_sigma, detail_max_sigma], so about 0.55 do."""
    share = {}
    for fraction in (0.0, 0.5):
        method = DMD2Method(validate(dmd2_config(tmp_path, prompts, steps=1, detail_fraction=fraction)))
        sigmas = method.draw_sigmas(4000, torch.Generator().manual_seed(0))
        assert 0.02 <= sigmas.min() and sigmas.max() <= 3 * 0.98 / (1 + 2 * 0.98)  # max_sigma, shifted
        share[fraction] = (sigmas <= 0.3).float().mean().item()
    assert share[0.0] < 0.15 and 0.5 < share[0.5] < 0.6


def test_ema_is_what_is_exported_and_resumes_bit_for_bit(prompts, tmp_path):
    """With ema_decay the export (and the checkpoint's loadable folder) is the EMA; the trained student
    is kept beside it, so a resumed run continues both exactly."""
    out = tmp_path / "ema"
    method = DMD2Method(validate(dmd2_config(out, prompts, steps=4, ema_decay=0.5)))
    start = [p.detach().clone() for p in method.student.parameters()]
    train(method.cfg, method, progress=False)
    ema, student = list(method.ema.parameters()), list(method.student.parameters())
    assert any(not torch.equal(e, s) for e, s in zip(ema, student, strict=True))
    assert any(not torch.equal(e, s) for e, s in zip(ema, start, strict=True))
    exported = fv_core.load("wan2.1-t2v-tiny", out / "final").instance.component("transformer")
    assert all(torch.equal(a, b) for a, b in zip(exported.parameters(), ema, strict=True))
    recipe = json.loads((out / "final" / "fv_recipe.json").read_text())
    assert recipe["exported"] == "ema" and recipe["ema_decay"] == 0.5
    assert (out / "checkpoint-2" / "student" / "transformer").is_dir()

    run = tmp_path / "resumed"
    shutil.copytree(out, run, ignore=shutil.ignore_patterns("checkpoint-4", "final"))
    resumed = DMD2Method(validate(dmd2_config(run, prompts, steps=4, ema_decay=0.5)))
    assert train(resumed.cfg, resumed, progress=False)["resumed_from"] == 2
    for a, b in ((method.ema, resumed.ema), (method.student, resumed.student)):
        assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def test_resuming_a_run_without_an_ema_with_one_is_refused(trained, prompts, tmp_path):
    _, _, out = trained
    method = DMD2Method(validate(dmd2_config(tmp_path, prompts, steps=4, ema_decay=0.9)))
    with pytest.raises(ConfigError, match=r"no student/ folder.*ema_decay.*0\.9 now.*Fix"):
        method.load(out / "checkpoint-2")


def test_empty_prompts_file_is_refused(tmp_path):
    empty = tmp_path / "p.txt"
    empty.write_text("# only a comment\n\n")
    with pytest.raises(ConfigError, match="holds no prompts.*Fix"):
        DMD2Method(validate(dmd2_config(tmp_path, empty, steps=1)))


def test_c2_student_train_forward_equals_the_served_cards_steps_bit_for_bit(prompts, tmp_path):
    """C2 gate: the 2-step student card's own serve loop (fixed timesteps 1000, 750, re-noising between
    them) gives each denoise step's input; on that input the method's train-profile forward (grad on)
    gives the served velocity and x0 exactly (fp32)."""
    card = "wan2.1-t2v-shapes-2step"
    options = {
        "teacher": card,
        "timesteps": [1000, 750],
    }  # the method's student starts from the served weights
    method = DMD2Method(validate(dmd2_config(tmp_path, prompts, steps=1, **options)))
    served_model = fv_core.load(card)
    # The served weights themselves (a copy in other memory can round differently in CPU matmuls,
    # whatever the profile), seen through the method: its sigmas, adapter calls and x0 formula.
    method.adapter = train_adapter(served_model)
    method.roles[Role.STUDENT]["transformer"] = served_model.instance.component("transformer")
    method.student.requires_grad_(True)
    prompt = "a blue square moving up"
    loop, request, instance = served_model.job(served_model.prepare({"prompt": prompt, "seed": 3}))
    state = loop.init(request, instance)
    embeds = method.adapter.conditioning([prompt])
    checked = 0
    while not isinstance(plan := loop.next(state), Done):
        result = run_plan(plan, Profile.SERVE)
        if plan.kind is WorkUnitKind.DIFFUSION_STEP:
            k, latents = checked, plan.inputs["latents"]
            served = result.outputs["velocity"]
            sigma = method.sigmas[k]
            trained_v = method.adapter.velocity(method.student, latents, sigma.expand(1), embeds, train=True)
            x0 = method.student_x0(latents, k, embeds, train=True)
            assert trained_v.requires_grad and x0.requires_grad and not served.requires_grad
            assert torch.equal(trained_v.detach(), served), k
            assert torch.equal(x0.detach(), latents - state.tensors["sigmas"][k] * served), k
            checked += 1
        state = loop.advance(state, result)
    assert checked == 2


def test_c2_on_a_recorded_rollout_of_the_student_card(prompts, tmp_path):
    """C2 gate on BehaviorRecords: a rollout of the served 2-step card records each denoise step's
    inputs and velocity; every recorded step replays bit for bit under the train profile
    (``check_c2``), and the method's train-profile x0 on the recorded inputs is the served sampler's
    x0 exactly (its schedule is the record's)."""
    card, prompt = "wan2.1-t2v-shapes-2step", "a green circle moving down"
    served_model = fv_core.load(card)
    (run,) = rollout(served_model, [{"prompt": prompt, "seed": 5}], batching=False)
    record = run.record
    assert torch.equal(record.schedule["timesteps"], torch.tensor([1000, 750]))
    method = DMD2Method(validate(dmd2_config(tmp_path, prompts, steps=1, teacher=card)))
    assert torch.equal(method.sigmas, record.schedule["sigmas"])
    method.adapter = train_adapter(served_model)  # the served weights themselves (see the test above)
    method.roles[Role.STUDENT]["transformer"] = served_model.instance.component("transformer")
    method.student.requires_grad_(True)
    embeds = method.adapter.conditioning([prompt])
    denoise = [i for i, s in enumerate(record.steps) if s.kind == WorkUnitKind.DIFFUSION_STEP.value]
    assert len(denoise) == 2
    for k, index in enumerate(denoise):
        step = record.steps[index]
        check_c2(served_model, record, index, ["velocity"])
        latents, velocity = step.inputs["latents"], step.outputs["velocity"]
        x0 = method.student_x0(latents, k, embeds, train=True)
        assert x0.requires_grad
        assert torch.equal(x0.detach(), latents - record.schedule["sigmas"][k] * velocity), k
