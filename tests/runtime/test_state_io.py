"""A LoopState is a resume point: save mid-run, load, finish, same bits."""

import pytest
import torch

from fv_core.loop import LoopContext, LoopRunner, LoopState, Profile, load_state, run_plan, save_state
from fv_core.request import Request
from fv_core.runtime import Engine
from tests.runtime.synthetic import PerRequestReuseInterceptor


@pytest.mark.parametrize("loop_name", ["denoise", "decode"])
def test_resume_from_saved_state_gives_the_same_result(tmp_path, model, loop_name, request):
    loop = request.getfixturevalue(loop_name)
    req = Request("r", params={"steps": 6, "tiles": 2, "max_tokens": 6}, seed=11)
    ctx = LoopContext(interceptors=(PerRequestReuseInterceptor(),))
    full = LoopRunner().run(loop, req, model, ctx)

    runner = LoopRunner()
    active = runner.start(loop, req, model, ctx)
    for _ in range(3):
        plan = runner.plan(active)
        runner.complete(active, plan, runner.before(active, plan) or run_plan(plan, Profile.SERVE))
    save_state(active.state, tmp_path / "resume")
    loaded = load_state(tmp_path / "resume")
    assert loaded.step == 3 and loaded.generator is not None
    resumed = Engine(interceptors=[PerRequestReuseInterceptor()]).run_one(loop, req, model, state=loaded)
    for name, value in full.outputs.items():
        assert torch.equal(value, resumed.outputs[name]), name


def test_nested_values_and_plugin_tensors_round_trip(tmp_path):
    gen = torch.Generator().manual_seed(3)
    torch.randn(4, generator=gen)
    state = LoopState(
        "r",
        "loop",
        step=2,
        total_steps=5,
        generator=gen,
        tensors={"x": torch.arange(6.0).reshape(2, 3)},
        values={"sigmas": [1.0, 0.5], "nested": {"k": torch.ones(2), "n": None}},
        plugin_state={"cache": {"main": {"v": torch.full((2,), 7.0), "hits": 3}}},
    )
    back = load_state(save_state(state, tmp_path / "s"))
    assert torch.equal(back.tensors["x"], state.tensors["x"]) and back.values["sigmas"] == [1.0, 0.5]
    assert torch.equal(back.values["nested"]["k"], torch.ones(2)) and back.values["nested"]["n"] is None
    assert back.plugin_state["cache"]["main"]["hits"] == 3
    assert torch.equal(torch.randn(3, generator=back.generator), torch.randn(3, generator=gen))
    assert not list((tmp_path / "s").glob("*.pkl")) and not list((tmp_path / "s").glob("*.pt"))


def test_unsaveable_state_is_refused_with_the_fix(tmp_path):
    state = LoopState("r", "loop", values={"model": object()})
    with pytest.raises(TypeError, match="LoopState values/model: object cannot be saved; keep only tensors"):
        save_state(state, tmp_path / "bad")
