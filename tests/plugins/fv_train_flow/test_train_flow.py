"""The flow method: loss goes down, checkpoints load and resume, train forward == serve forward."""

import json
import shutil

import pytest
import torch
from train_flow_support import flow_config

from fv_core import ConfigError, load
from fv_core.cache import RepeatedTail
from fv_core.loop import Profile, WorkUnitKind, run_plan
from fv_core.training import Role, load_config, train, validate
from fv_train_flow.method import FlowMethod


def test_a_few_steps_reduce_the_validation_loss(trained):
    method, before, out = trained
    after = method.evaluate(24)
    assert after["val_loss"] < 0.9 * before["val_loss"], (before["val_loss"], after["val_loss"])
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if "loss" in r] == list(range(1, 25))
    assert (out / "loss.png").stat().st_size > 0


def test_checkpoint_is_a_loadable_wan_model_and_generates(trained):
    _, _, out = trained
    model = load(weights=out / "final")  # the card comes from the checkpoint's own configs
    loop, request, instance = model.job(model.prepare({"prompt": "a red circle moving left", "num_frames": 9,
        "height": 64, "width": 64, "num_inference_steps": 2, "guidance_scale": 4.0}))  # fmt: skip
    from fv_core.runtime import Engine

    with torch.inference_mode():
        frames = Engine().run_one(loop, request, instance).outputs["frames"]
    assert frames.shape == (9, 64, 64, 3) and torch.isfinite(frames).all()


def test_training_resumes_from_the_newest_checkpoint(trained, vae_dir, tmp_path):
    method, _, out = trained
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-12", "checkpoint-24"]
    run = tmp_path / "run"
    shutil.copytree(out, run, ignore=shutil.ignore_patterns("checkpoint-24"))
    resumed = FlowMethod(validate(flow_config(run, vae_dir, steps=24, checkpoint_every=12)))
    summary = train(resumed.cfg, resumed, progress=False)  # re-runs steps 12..24 from checkpoint-12
    assert summary["resumed_from"] == 12
    for name, module in method.roles[Role.STUDENT].items():  # same data, noise and steps: same weights
        for a, b in zip(module.parameters(), resumed.roles[Role.STUDENT][name].parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    log = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if "loss" in r] == list(range(1, 25))  # no step logged twice


def test_train_forward_equals_serve_forward_bit_for_bit(trained):
    """The serve loop's own denoise plan, run under the train profile on the student's weights, gives
    the serve profile's output exactly; the train-side text path reproduces the serve kv exactly."""
    method, _, out = trained
    model = load(weights=out / "final")  # EMA weights
    loop, request, instance = model.job(model.prepare({"prompt": "a blue square moving up", "num_frames": 9,
        "height": 64, "width": 64, "num_inference_steps": 3, "guidance_scale": 1.0, "seed": 1}))  # fmt: skip
    state = loop.init(request, instance)
    while (plan := loop.next(state)).kind is not WorkUnitKind.DIFFUSION_STEP:
        state = loop.advance(state, run_plan(plan, Profile.SERVE))
    served = run_plan(plan, Profile.SERVE).outputs["velocity"]
    trained_out = run_plan(plan, Profile.TRAIN).outputs["velocity"]
    assert trained_out.requires_grad and not served.requires_grad
    assert torch.equal(trained_out.detach(), served)
    ema = method.roles[Role.EMA]
    with torch.no_grad():
        text = method.adapter.conditioning(["a blue square moving up"], ema["text_encoder"])
        from fv_wan.bodies import text_kv_body

        kv = text_kv_body(ema["transformer"], {"text": text})["kv"]
    # the serve plan holds the prompt's keys/values folded: each row's positions up to its padding
    rows = plan.inputs["kv_rows"]
    served_kv = [
        RepeatedTail(plan.inputs["kv"][r].narrow(-2, 0, int(n)), kv.shape[-2], -2) for r, n in enumerate(rows)
    ]
    assert torch.equal(kv, torch.stack([f.expand() for f in served_kv]))


def test_config_errors_name_the_field_and_the_fix(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("method: flow\noutput_dir: x\nsteps: 0\nbatch_sise: 4\n")
    with pytest.raises(ConfigError) as err:
        load_config(bad)
    assert "steps" in str(err.value) and "batch_sise" in str(err.value) and "Fix:" in str(err.value)
    cfg = validate(
        {"method": "flow", "output_dir": str(tmp_path), "steps": 1, "options": {"vae": str(tmp_path)}}
    )
    with pytest.raises(ConfigError, match="not a diffusers vae/ folder"):
        FlowMethod(cfg)
    cfg = validate({"method": "flow", "output_dir": str(tmp_path), "steps": 1, "options": {"shift": -1}})
    with pytest.raises(ConfigError, match="options.*shift|shift"):
        FlowMethod(cfg)
