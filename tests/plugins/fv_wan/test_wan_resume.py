"""A Wan LoopState is a resume point: saved mid-denoise, loaded, finished == uninterrupted."""

from __future__ import annotations

import torch
from wan_support import request

from fv_core.loop import LoopContext, LoopRunner, load_state, run_plan, save_state
from fv_wan.t2v_loop import WanLoop


def test_resume_from_saved_state_is_bit_identical(tiny_model, tmp_path):
    req = request(tiny_model, "resume", seed=9, num_inference_steps=4, sampler="unipc")
    runner, ctx = LoopRunner(), LoopContext()
    with torch.no_grad():
        full = runner.run(WanLoop(tiny_model), req, tiny_model, ctx).outputs["frames"]
        active = runner.start(WanLoop(tiny_model), req, tiny_model, ctx)
        while active.state.step < 2:  # encode, text K/V, two denoise steps (UniPC history is now in state)
            plan = runner.plan(active)
            runner.complete(active, plan, run_plan(plan, ctx.profile))
        save_state(active.state, tmp_path / "state")
        resumed = runner.run(WanLoop(tiny_model), req, tiny_model, ctx, state=load_state(tmp_path / "state"))
    assert torch.equal(resumed.outputs["frames"], full)
