"""Synthetic loops through the engine: diffusion, AR decode, programs, heterogeneous units, profiles."""

from dataclasses import replace

import pytest
import torch

from fv_core.errors import ConfigError
from fv_core.loop import LoopContext, LoopRunner, Profile, StepResult, WorkPlan
from fv_core.program import Program, Stage
from fv_core.request import Request
from fv_core.runtime import Engine
from tests.runtime.synthetic import DenoiseLoop, SyntheticModel


def test_diffusion_is_seeded_and_deterministic(model, denoise):
    run = lambda seed: Engine().run_one(denoise, Request("r", params={"steps": 4}, seed=seed), model)  # noqa: E731
    a, b, c = run(1), run(1), run(2)
    assert torch.equal(a.outputs["latents"], b.outputs["latents"])
    assert not torch.equal(a.outputs["latents"], c.outputs["latents"])
    ran_on = {"dit": "v1"}  # the versions it was pinned to
    assert a.metrics == {"steps": 4, "stop_reason": "finished", "weights_versions": ran_on}


def test_runner_alone_matches_engine(model, denoise):
    req = Request("r", params={"steps": 3}, seed=5)
    alone = LoopRunner().run(denoise, req, model, LoopContext())
    engine = Engine().run_one(denoise, req, model)
    assert torch.equal(alone.outputs["latents"], engine.outputs["latents"])


def test_ar_decode_stops_at_max_tokens_and_eos(model, decode):
    greedy = {"temperature": 0.0, "max_tokens": 6, "prompt": [3, 1, 4]}
    full = Engine().run_one(decode, Request("a", params=greedy), model)
    assert full.metrics["stop_reason"] == "max_tokens" and len(full.outputs["tokens"]) == 6
    eos = int(full.outputs["tokens"][2])
    first_eos = full.outputs["tokens"].tolist().index(eos)
    stopped = Engine().run_one(decode, Request("b", params={**greedy, "eos": eos}), model)
    assert stopped.metrics["stop_reason"] == "eos"
    assert stopped.outputs["tokens"].tolist() == full.outputs["tokens"][: first_eos + 1].tolist()


def test_loop_rejects_a_foreign_instance(denoise):
    with pytest.raises(ConfigError, match="bound to one SyntheticModel"):
        Engine().run_one(denoise, Request("r"), SyntheticModel(seed=1))


def _bind_tokens(request, results):
    return replace(request, params={**request.params, "tokens": results["decode"].outputs["tokens"]})


def test_two_loop_program_shares_one_component_instance(model, decode, denoise):
    program = Program(
        "t2i_with_prompt_ar", [Stage("decode", decode), Stage("denoise", denoise, _bind_tokens)]
    )
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    req = Request("p", params={"max_tokens": 3, "steps": 3, "temperature": 0.0})
    result = Engine().run_one(program, req, model)
    assert decode.model.dit is denoise.model.dit  # one live transformer, two loops
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs  # no weight copy
    assert result.metrics["steps"] == 6 and set(result.metrics["stages"]) == {"decode", "denoise"}
    tokens = Engine().run_one(decode, Request("d", params=req.params), model).outputs["tokens"]
    direct = Engine().run_one(denoise, Request("x", params={**req.params, "tokens": tokens}), model)
    assert torch.equal(result.outputs["latents"], direct.outputs["latents"])


def test_vae_tiles_interleave_with_denoise_steps(model, denoise):
    order = []
    items = [
        (denoise, Request("tiles", params={"steps": 2, "tiles": 4}, seed=1), model),
        (denoise, Request("plain", params={"steps": 6}, seed=2), model),
    ]
    engine = Engine(on_event=lambda e: e.kind == "progress" and order.append((e.request_id, e.data)))
    results = engine.run_interleaved(items)
    assert results[0].outputs["pixels"].shape == (1, 8, 12)
    kinds = [label.split()[0] for rid, label in order[:8]]
    assert kinds == ["denoise", "denoise", "denoise", "denoise", "vae", "denoise", "vae", "denoise"]
    serial = Engine().run_serial(items)
    assert torch.equal(serial[0].outputs["pixels"], results[0].outputs["pixels"])


def test_rollout_profile_captures_behaviour_from_the_same_loop(model, denoise):
    req = Request("r", params={"steps": 3, "guidance": 2.0}, seed=7)
    served = Engine().run_one(denoise, req, model)
    rolled = Engine(profile=Profile.ROLLOUT).run_one(denoise, req, model)
    assert served.behavior is None and torch.equal(served.outputs["latents"], rolled.outputs["latents"])
    rec = rolled.behavior
    assert (rec.seed, rec.guidance, rec.weights_versions) == (7, 2.0, {"dit": "v1"})
    assert len(rec.schedule["sigmas"]) == 4 and [s.step for s in rec.steps] == [0, 1, 2]
    assert rec.steps[0].kind == "diffusion_step" and rec.steps[0].outputs["v"].shape == (1, 8, 16)


class _GradProbe:
    plugin_id = "grad_probe"

    def __init__(self) -> None:
        self.seen: list[bool] = []

    def before(self, state, plan: WorkPlan) -> None:
        return None

    def after(self, state, plan: WorkPlan, result: StepResult) -> StepResult:
        self.seen.append(result.outputs["v"].requires_grad)
        return result


def test_train_profile_runs_the_step_body_with_grad(model, denoise):
    serve, train = _GradProbe(), _GradProbe()
    Engine(interceptors=[serve]).run_one(denoise, Request("s", params={"steps": 2}), model)
    Engine(profile=Profile.TRAIN, interceptors=[train]).run_one(
        denoise, Request("t", params={"steps": 2}), model
    )
    assert serve.seen == [False, False] and train.seen == [True, True]


def test_loops_are_reusable_across_instances():
    a, b = SyntheticModel(seed=0), SyntheticModel(seed=1)
    out_a = Engine().run_one(DenoiseLoop(a), Request("r", params={"steps": 2}), a)
    out_b = Engine().run_one(DenoiseLoop(b), Request("r", params={"steps": 2}), b)
    assert not torch.equal(out_a.outputs["latents"], out_b.outputs["latents"])
