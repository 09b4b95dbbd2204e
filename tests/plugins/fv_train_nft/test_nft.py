"""fv-train-nft: DiffusionNFT steps on the tiny Wan card (random weights), its math, the C2 gate,
resume and options. A brightness reward stands in for a real one where the tiny model's random
videos would give the detector nothing to read (so advantages are not all zero)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

import fv_core
from fv_core import ConfigError
from fv_core.loop import Profile, WorkUnitKind
from fv_core.loop.runner import run_plan
from fv_core.plugins import PluginHost
from fv_core.training import Consistency, Role, load_records, records_equal, save_records, train, validate
from fv_train_nft import plugin
from fv_train_nft.config import NftOptions
from fv_train_nft.lora import merged_weights
from fv_train_nft.loss import advantages, nft_loss, old_decay, optimality
from fv_train_nft.method import NftMethod
from fv_train_nft.rewards import ConstantReward, PositionDebiasedShapesReward, debias

PROMPTS = ["a red circle moving left", "a blue square moving up", "a green circle moving down"]


def nft_config(out: Path, steps: int, **options) -> dict:
    return {
        "method": "nft",
        "output_dir": str(out),
        "steps": steps,
        "batch_size": 4,
        "log_every": 1,
        "eval_every": 1000,
        "checkpoint_every": 1,
        "optim": {"lr": 1e-3, "warmup_steps": 0, "decay": "constant"},
        "options": {
            "card": "wan2.1-t2v-tiny",
            "prompts": PROMPTS,
            "prompts_per_step": 2,
            "group_size": 2,
            "rollout_steps": 3,
            "max_sequence_length": 16,
            "eval_seeds": 0,
            "eta_rate": 0.25,  # reach a visible blend within a few steps
            **options,
        },
    }


def brightness(frames: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """A reward that differs between any two videos: mean brightness."""
    return frames.float().mean(dim=(1, 2, 3, 4))


def make(out: Path, steps: int, **options) -> NftMethod:
    method = NftMethod(validate(nft_config(out, steps, **options)))
    method.reward = brightness
    return method


def params(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


@pytest.fixture(scope="module")
def stepped(tmp_path_factory):
    """A method before and after two manual steps, with the old policy's weights around the second."""
    method = make(tmp_path_factory.mktemp("nft"), steps=2)
    start = {role: params(m["transformer"]) for role, m in method.roles.items()}
    first = method.step(0)
    old_before = params(method.roles[Role.OLD]["transformer"])
    second = method.step(1)
    return method, start, old_before, (first, second)


def test_steps_give_finite_losses_and_move_only_the_student(stepped):
    method, start, _, logs = stepped
    for log in logs:
        assert all(torch.isfinite(torch.tensor(v)) for v in log.values()), log
        assert log["r_mean_abs_dev"] > 0  # the brightness reward separates the groups' videos
    student = method.roles[Role.STUDENT]["transformer"].parameters()
    assert any(not torch.equal(a, b) for a, b in zip(start[Role.STUDENT], student, strict=True))
    reference = method.roles[Role.REFERENCE]["transformer"].parameters()
    assert all(torch.equal(a, b) for a, b in zip(start[Role.REFERENCE], reference, strict=True))
    # the rollout model's live transformer is the old role (the engine samples with its weights)
    assert method.adapter.module("transformer") is method.roles[Role.OLD]["transformer"]
    # and step 1's rollouts ran on the old policy after step 0's update (its bumped weights version)
    assert method.versions == ["nft-old-1"] * 4 and method.old_version == "nft-old-2"


def test_rollouts_run_through_the_core_rollout_and_their_records_round_trip(stepped, tmp_path):
    """Every rollout video has a BehaviorRecord (content hashes) on the old policy's weights version
    and with its own seed; saved and reloaded, the records are the same."""
    method = stepped[0]
    prompts, seeds = ["a red circle moving left", "a blue square moving up"], [11, 12]
    method.generate(method.model, prompts, seeds, method.opts.rollout_steps, 1.0)
    assert [r.seed for r in method.records] == seeds
    assert all(len(r.steps) > method.opts.rollout_steps for r in method.records)  # denoise steps and more
    assert {r.weights_versions["transformer"] for r in method.records} == set(method.versions)
    loaded = load_records(save_records(tmp_path / "records", method.records))
    assert all(records_equal(a, b) for a, b in zip(loaded, method.records, strict=True))
    opts = method.opts
    method.opts = opts.model_copy(update={"save_records": True})
    try:
        method.rollout(7)  # save_records: each step's records under output_dir/rollouts/
    finally:
        method.opts = opts
    saved = load_records(Path(method.cfg.output_dir) / "rollouts" / "step-000007")
    assert all(records_equal(a, b) for a, b in zip(saved, method.records, strict=True))
    assert len(saved) == method.opts.prompts_per_step * method.opts.group_size


def test_old_policy_moves_by_the_decay_rule_exactly(stepped):
    method, _, old_before, (_, second) = stepped
    eta = old_decay(2, 0.25, 0.5)
    assert eta == second["eta"] == 0.5
    student = method.roles[Role.STUDENT]["transformer"].parameters()
    old = method.roles[Role.OLD]["transformer"].parameters()
    for before, s, o in zip(old_before, student, old, strict=True):
        assert torch.equal(o, before * eta + s.detach() * (1 - eta))
    # the published schedule: min(0.001 * step, 0.5), with an optional flat start
    assert [old_decay(s, 0.001, 0.5) for s in (0, 1, 300, 499, 500, 10_000)] == [
        0.0, 0.001, 0.3, 0.499, 0.5, 0.5,
    ]  # fmt: skip
    assert old_decay(3, 0.1, 0.5, flat=5) == 0.0 and old_decay(7, 0.1, 0.5, flat=5) == pytest.approx(0.2)


def test_advantages_are_group_relative_and_map_to_r():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, 4.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    adv = advantages(rewards, groups, global_std=True)
    std = rewards.double().std(unbiased=False)
    expected = torch.tensor([0.5, -0.5, 0.0, 0.0, -1.0, 1.0], dtype=torch.float64) / (std + 1e-4)
    assert torch.allclose(adv.double(), expected, atol=1e-6)
    r = optimality(torch.tensor([-10.0, -2.5, 0.0, 2.5, 10.0]), clip_max=5.0)
    assert torch.equal(r, torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0]))
    constant = ConstantReward(1.0)(torch.zeros(6, 2, 4, 4, 3), ["x"] * 6)
    assert torch.equal(optimality(advantages(constant, groups), 5.0), torch.full((6,), 0.5))


def _loss_inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shape = (3, 4, 2, 3, 3)
    x0, eps = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    t = torch.tensor([0.2, 0.5, 0.9])
    x_t = (1 - t.view(-1, 1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1, 1) * eps
    v_old = eps - x0 + 0.3 * torch.randn(shape, generator=g)
    return x0, x_t, t, v_old, torch.randn(shape, generator=g) * 0.1


@pytest.mark.parametrize("beta", [1.0, 0.3])
def test_zero_advantage_leaves_only_the_symmetric_term(beta):
    """r = 1/2: the positive and negative terms mirror each other around v_old, so the policy
    gradient is exactly what ((e)^2 + t^2 beta^2 (v - v_old)^2) / beta gives: 2 t^2 beta (v - v_old)
    (times adv_clip_max / elements) - it pulls v back to v_old and carries no reward direction."""
    x0, x_t, t, v_old, delta = _loss_inputs()
    r = torch.full((3,), 0.5)
    v = (v_old + delta).requires_grad_(True)
    parts = nft_loss(v, v_old, v_old, x_t, x0, t, r, beta, 0.0, 5.0, adaptive_weight=False)
    (grad,) = torch.autograd.grad(parts.policy, v)
    per_sample = x0[0].numel()
    te = t.view(-1, 1, 1, 1, 1)
    expected = 5.0 * 2 * te**2 * beta * delta / (per_sample * len(t))
    assert torch.allclose(grad, expected, atol=1e-7, rtol=1e-5)
    # at the old policy itself (the first step, or a control run) the gradient vanishes, adaptive
    # weights included: exactly at beta = 1 (v+ = v and v- = 2 v_old - v are then v_old bit for bit),
    # to rounding otherwise
    v0 = v_old.clone().requires_grad_(True)
    parts = nft_loss(v0, v_old, v_old, x_t, x0, t, r, beta, 1e-4, 5.0, adaptive_weight=True)
    (grad0,) = torch.autograd.grad(parts.loss, v0)
    if beta == 1.0:
        assert torch.count_nonzero(grad0) == 0
    assert grad0.abs().max() < 1e-6
    # an advantage breaks the symmetry: r > 1/2 moves v toward the data's velocity, r < 1/2 away
    up = nft_loss(v0, v_old, v_old, x_t, x0, t, torch.ones(3), beta, 0.0, 5.0, False).policy
    (g_up,) = torch.autograd.grad(up, v0)
    target = (x_t - x0) / t.view(-1, 1, 1, 1, 1)  # the velocity that reproduces x0 exactly
    assert (g_up * (v_old - target)).sum() > 0  # descending the gradient approaches the target


def test_constant_reward_gives_r_one_half_and_no_policy_gradient(tmp_path):
    method = NftMethod(
        validate(nft_config(tmp_path, 1, reward={"name": "constant", "options": {"value": 2.0}}))
    )
    batch = method.rollout(0)
    assert torch.equal(batch["advantages"], torch.zeros(4))
    assert torch.equal(batch["r"], torch.full((4,), 0.5))
    before = params(method.roles[Role.STUDENT]["transformer"])
    method.accumulate(batch, batch["generator"])  # student == old == reference: every term is zero
    grads = [p.grad for p in method.roles[Role.STUDENT]["transformer"].parameters()]
    assert all(g is None or torch.count_nonzero(g) == 0 for g in grads)
    after = method.roles[Role.STUDENT]["transformer"].parameters()
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_the_reward_moves_the_policy_its_way(tmp_path):
    """From the same start, rewarding brightness makes the old policy's videos brighter than
    rewarding darkness does (fixed probe prompts and seeds, outside the rollouts' seeds)."""
    probes = {}
    for sign in (1.0, -1.0):
        method = make(tmp_path / str(sign), steps=8, prompts_per_step=3, group_size=4, eta_rate=0.001)
        method.reward = lambda frames, prompts, sign=sign: sign * brightness(frames, prompts)
        for step in range(8):
            method.step(step)
        _, frames = method.generate(method.model, PROMPTS * 2, list(range(6)), 3, 1.0)
        probes[sign] = frames.mean().item()
    assert probes[1.0] > probes[-1.0], probes


def test_c2_train_forward_equals_serve_forward_bit_for_bit(stepped, tmp_path):
    """What NFT trains on is the student's velocity at forward-noised rollout latents: the train
    profile (grad) equals the serve profile on the same input bit for bit, through the adapter and
    through the serve loop's own denoise plan on the exported student."""
    method, *_ = stepped
    student = method.roles[Role.STUDENT]["transformer"]
    batch = method.rollout(5)
    t = method.sigmas[torch.tensor([0, 1, 2, 1])]  # 4 rollout samples, levels of the schedule
    noise = torch.randn(batch["latents"].shape, generator=torch.Generator().manual_seed(3))
    x_t = (1 - t.view(-1, 1, 1, 1, 1)) * batch["latents"] + t.view(-1, 1, 1, 1, 1) * noise
    with torch.no_grad():
        embeds = method.adapter.conditioning(batch["prompts"])
    trained = method.adapter.velocity(student, x_t, t, embeds, True)
    served = method.adapter.velocity(student, x_t, t, embeds, False)
    assert trained.requires_grad and not served.requires_grad
    assert torch.equal(trained.detach(), served)

    method.export(tmp_path / "student")
    model = fv_core.load("wan2.1-t2v-tiny", tmp_path / "student")
    loop, request, instance = model.job(model.prepare({"prompt": PROMPTS[0], "seed": 1,
        "guidance_scale": 1.0, "max_sequence_length": 16}))  # fmt: skip
    state = loop.init(request, instance)
    while (plan := loop.next(state)).kind is not WorkUnitKind.DIFFUSION_STEP:
        state = loop.advance(state, run_plan(plan, Profile.SERVE))
    serve_out = run_plan(plan, Profile.SERVE).outputs["velocity"]
    train_out = run_plan(plan, Profile.TRAIN).outputs["velocity"]
    assert train_out.requires_grad and torch.equal(train_out.detach(), serve_out)
    assert NftMethod.spec.consistency is Consistency.C2_FREE


@pytest.mark.parametrize("options", [{}, {"lora_rank": 2}], ids=["full", "lora"])
def test_resume_equals_an_uninterrupted_run(tmp_path, options):
    whole = make(tmp_path / "whole", steps=3, **options)
    train(validate(nft_config(tmp_path / "whole", 3, **options)), whole, progress=False)
    first = make(tmp_path / "split", steps=2, **options)
    train(validate(nft_config(tmp_path / "split", 2, **options)), first, progress=False)
    resumed = make(tmp_path / "split", steps=3, **options)
    summary = train(validate(nft_config(tmp_path / "split", 3, **options)), resumed, progress=False)
    assert summary["resumed_from"] == 2
    for role in (Role.STUDENT, Role.OLD):
        a = whole.roles[role]["transformer"].state_dict()
        b = resumed.roles[role]["transformer"].state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a), role
    exported = fv_core.load("wan2.1-t2v-tiny", tmp_path / "whole" / "final")
    recipe = (tmp_path / "whole" / "final" / "fv_recipe.json").read_text()
    assert '"method": "nft"' in recipe and exported.card.model_id == "wan2.1-t2v-tiny"


def test_a_lora_student_trains_only_adapters_and_folds_them_into_old_and_export(tmp_path):
    method = make(tmp_path, steps=1, lora_rank=2)
    student = method.roles[Role.STUDENT]["transformer"]
    trained = {n for n, p in student.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    optimised = {id(p) for group in method.opt.param_groups for p in group["params"]}
    assert optimised == {id(p) for n, p in student.named_parameters() if n in trained}
    start = {n: p.detach().clone() for n, p in method.roles[Role.OLD]["transformer"].named_parameters()}
    method.step(0)
    merged = merged_weights(student)
    assert set(merged) == set(start)
    assert any(not torch.equal(merged[n], start[n]) for n in start)  # the adapters moved the weights
    base = {n.replace(".base_layer.", "."): p for n, p in student.named_parameters() if not p.requires_grad}
    assert all(torch.equal(base[n], start[n]) for n in start)  # the base weights did not
    eta = old_decay(1, 0.25, 0.5)
    for name, old in method.roles[Role.OLD]["transformer"].named_parameters():
        assert torch.equal(old, start[name] * eta + merged[name] * (1 - eta)), name
    method.export(tmp_path / "exported")
    served = fv_core.load("wan2.1-t2v-tiny", tmp_path / "exported").instance.component("transformer")
    assert all(torch.equal(p, merged[n]) for n, p in served.named_parameters())
    recipe = (tmp_path / "exported" / "fv_recipe.json").read_text()
    assert '"rank": 2' in recipe


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"group_size": 1}, "group_size"),
        ({"bogus": 1}, "bogus"),
        ({"prompts_file": "p.txt"}, "exactly one of prompts"),
        ({"train_timesteps": 9}, "train_timesteps=9 exceeds"),
        ({"beta": 0}, "beta"),
        ({"max_level": 1.5}, "max_level"),
        ({"rollout_guidance": [0.5]}, "rollout_guidance"),
        ({"train_groups": 3}, "train_groups=3 exceeds"),
        ({"distinct_prompts": True, "prompts_per_step": 4}, r"prompts_per_step=4 distinct .* 3 prompts.*Fix"),
        ({"reward": {"name": "shapes-detector", "options": {"weights": {"size": 1}}}}, "weights"),
    ],
)
def test_bad_options_are_config_errors_that_name_the_field(tmp_path, options, match):
    with pytest.raises(ConfigError, match=match):
        NftMethod(validate(nft_config(tmp_path, 1, **options)))


def test_hooks_register_the_method_options_and_constant_reward():
    host = PluginHost({})
    host.add(plugin, "fv-train-nft")
    host.collect()
    assert host.infos["fv-train-nft"].hooks == [
        "fv_register_methods",
        "fv_register_options",
        "fv_register_rewards",
    ]
    assert host.registries.methods.get("nft") is NftMethod
    assert host.registries.options.get("fv-train-nft") is NftOptions
    assert host.registries.rewards.get("constant") is ConstantReward
    assert host.registries.rewards.get("shapes-position-debiased") is PositionDebiasedShapesReward
    roles = {r.role for r in NftMethod.spec.roles}
    assert roles == {Role.STUDENT, Role.OLD, Role.REFERENCE}
    assert NftMethod.spec.role(Role.STUDENT).trains == ("transformer",)
    assert copy.copy(NftMethod.spec.describe())["consistency"] == "C2-free"


@pytest.mark.parametrize("guided_grad", ["both", "uncond"])
def test_guided_groups_train_the_cfg_combine_of_each_role(tmp_path, guided_grad):
    """Groups rolled out at g > 1 roll out with CFG and train ``v_u + g (v_c - v_u)``: equal to the
    old policy's at step 0, so the loss is the symmetric term's, and the student moves."""
    method = make(tmp_path, steps=1, rollout_guidance=[1.0, 4.0], guided_grad=guided_grad)
    batch = method.rollout(0)
    assert batch["guidance"].tolist() == [1.0, 1.0, 4.0, 4.0]
    x0, t = batch["latents"], method.sigmas[torch.tensor([0, 1, 2, 1])]
    x_t = (1 - t.view(-1, 1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1, 1) * torch.randn_like(x0)
    method.negative = method.adapter.conditioning([method.negative_prompt()])
    embeds = method.adapter.conditioning(batch["prompts"])
    with torch.no_grad():
        guided = method.guided(Role.OLD, x_t, t, embeds, batch["guidance"], False)
        velocity = method.adapter.velocity
        old = method.roles[Role.OLD]["transformer"]
        v_c = velocity(old, x_t, t, embeds, False)
        v_u = velocity(old, x_t[2:], t[2:], method.negative.expand(2, *embeds.shape[1:]), False)
    assert torch.allclose(guided[:2], v_c[:2], atol=1e-5)
    assert torch.allclose(guided[2:], v_u + 4.0 * (v_c[2:] - v_u), atol=1e-4)
    before = params(method.roles[Role.STUDENT]["transformer"])
    log = method.step(1)
    assert {"reward@g1", "reward@g4"} <= set(log)
    after = params(method.roles[Role.STUDENT]["transformer"])
    assert any(not torch.equal(a, b) for a, b in zip(after, before, strict=True))


def test_guided_loss_power_weights_each_guided_sample_by_g_to_minus_the_power(tmp_path):
    method = make(tmp_path, steps=1, rollout_guidance=[1.0, 4.0], guided_loss_power=2.0)
    method.negative = method.adapter.conditioning([method.negative_prompt()])
    x0 = torch.randn(4, *method.adapter.noise(1, torch.Generator().manual_seed(0)).shape[1:])
    t, g = method.sigmas[torch.tensor([0, 1, 0, 1])], torch.tensor([1.0, 1.0, 4.0, 4.0])
    x_t = (1 - t.view(-1, 1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1, 1) * torch.randn_like(x0)
    embeds = method.adapter.conditioning(PROMPTS[:2] * 2)
    r = torch.tensor([0.9, 0.2, 0.7, 0.4])
    with torch.no_grad():
        weighted = method.loss(x_t, x0, t, embeds, r, g).policy
        method.opts.guided_loss_power = 0.0
        each = [method.loss(x_t[i : i + 1], x0[i : i + 1], t[i : i + 1], embeds[i : i + 1], r[i : i + 1],
                            g[i : i + 1]).policy for i in range(4)]  # fmt: skip
    expected = (each[0] + each[1] + (each[2] + each[3]) / 16) / 4
    assert torch.allclose(weighted, expected, rtol=1e-4) and not torch.allclose(weighted, sum(each) / 4)
    assert make(tmp_path / "b", steps=1).opts.guided_loss_power == 0.0  # default: every sample alike


def test_train_groups_keeps_the_most_varied_groups_per_cfg_scale(tmp_path):
    method = make(tmp_path, steps=1, prompts_per_step=4, rollout_guidance=[1.0, 4.0], train_groups=2)
    groups = torch.arange(4).repeat_interleave(2)  # groups 0, 2 at g1; 1, 3 at g4
    rewards = torch.tensor([0.0, 1.0, 0.5, 0.6, 0.1, 0.9, 0.5, 0.5])  # stds 0.5, 0.05, 0.4, 0
    assert method.trained_samples(rewards, groups).tolist() == [0, 1, 2, 3]  # g1: group 0; g4: group 1
    method.opts.rollout_guidance = [1.0]
    assert method.trained_samples(rewards, groups).tolist() == [0, 1, 4, 5]  # groups 0 and 2


def test_position_debiased_scores_do_not_depend_on_start_distance():
    scores = torch.tensor([1.0, 0.9, 0.5, 0.4, 1.0, 1.0, 0.0, 0.7])
    dist = torch.tensor([5.0, 8.0, 16.0, 18.0, 5.0, 15.0, float("nan"), 10.0])
    shapes = ["square"] * 4 + ["circle"] * 4
    out = debias(scores, dist, shapes, min_fit=3)
    sq = out[:4].double()
    xc = dist[:4].double() - dist[:4].double().mean()
    assert abs(float((xc * (sq - sq.mean())).sum())) < 1e-5  # no linear trend left
    assert abs(float(sq.mean() - scores[:4].double().mean())) < 1e-6  # the mean is kept
    assert out[6] == 0.0  # no position: unchanged
    assert torch.equal(debias(scores, dist, shapes, min_fit=8), scores)  # too few to fit


@pytest.mark.parametrize("shared_noise", [False, True])
def test_shared_noise_noises_a_groups_members_alike(tmp_path, shared_noise):
    """With shared_noise every member of a group is forward-noised with the same eps at the same
    levels (common random numbers); without, each sample draws its own eps."""
    method = make(tmp_path, steps=1, shared_noise=shared_noise, train_timesteps=2)
    batch = method.rollout(0)
    latents, groups = batch["latents"], batch["groups"].tolist()
    eps: dict[tuple[int, float], list[torch.Tensor]] = {}  # (group, level) -> its members' eps
    loss = method.loss

    def record(x_t, x0, t, *rest):
        for k in range(len(x0)):
            row = next(i for i in range(len(latents)) if torch.equal(latents[i], x0[k]))
            eps.setdefault((groups[row], round(float(t[k]), 6)), []).append(
                (x_t[k] - (1 - t[k]) * x0[k]) / t[k]
            )
        return loss(x_t, x0, t, *rest)

    method.loss = record
    method.accumulate(batch, batch["generator"])
    assert sum(len(m) for m in eps.values()) == 2 * len(latents)  # train_timesteps levels per sample
    pairs = [m for m in eps.values() if len(m) == 2]  # never empty: 2 of 3 levels per member
    assert pairs
    if shared_noise:
        assert len(pairs) == len(eps) == 2 * len(set(groups))  # each group: both members, 2 levels
    assert all(torch.allclose(a, b, atol=1e-4) == shared_noise for a, b in pairs)


def test_group_variation_makes_a_groups_videos_variations_of_one_seed(tmp_path):
    """group_variation: each member is a variation (variation seed = its own seed) of the group's
    seed. At strength 1 that is exactly the independent rollout; at a small one a group's latents lie
    closer together than other groups' do."""
    independent = make(tmp_path / "a", steps=1, prompts=PROMPTS[:1]).rollout(0)["latents"]
    full = make(tmp_path / "b", steps=1, prompts=PROMPTS[:1], group_variation=1.0).rollout(0)["latents"]
    assert torch.equal(full, independent)
    near = make(tmp_path / "c", steps=1, prompts=PROMPTS[:1], group_variation=0.1).rollout(0)["latents"]
    within = [(near[0] - near[1]).norm(), (near[2] - near[3]).norm()]
    across = [(near[i] - near[j]).norm() for i in (0, 1) for j in (2, 3)]
    assert max(within) < min(across)


@pytest.mark.parametrize("distinct", [True, False])
def test_distinct_prompts_draws_a_fresh_subset_each_step(tmp_path, distinct):
    """As published, a step's groups are distinct prompts; drawn with replacement some repeat."""
    method = make(
        tmp_path, steps=1, distinct_prompts=distinct, prompts_per_step=3, group_size=2, rollout_steps=1
    )
    draws = [method.rollout(step)["prompts"][::2] for step in range(8)]
    assert all(len(set(d)) == 3 for d in draws) == distinct
