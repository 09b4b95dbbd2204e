"""The parity harness: interleave gate, batched parity, aligner, compare helpers."""

from dataclasses import replace

import pytest
import torch

from fv_core.loop import StepResult, WorkPlan
from fv_core.parity import (
    ParityAligner,
    assert_interleave_parity,
    check_batched_parity,
    max_abs,
    max_rel,
    psnr,
)
from fv_core.program import Program, Stage
from fv_core.request import Request
from fv_core.runtime import Engine
from tests.runtime import synthetic
from tests.runtime.synthetic import GlobalReuseInterceptor, PerRequestReuseInterceptor


def _mixed_items(model, denoise, decode):
    program = Program(
        "ar_then_diffusion",
        [
            Stage("decode", decode),
            Stage(
                "denoise",
                denoise,
                lambda r, res: replace(r, params={**r.params, "tokens": res["decode"].outputs["tokens"]}),
            ),
        ],
    )
    return [
        (denoise, Request("d0", params={"steps": 5}, seed=0), model),
        (denoise, Request("d1", params={"steps": 3, "tiles": 2, "guidance": 1.5}, seed=1), model),
        (decode, Request("a0", params={"max_tokens": 5}, seed=2), model),
        (decode, Request("a1", params={"max_tokens": 7, "eos": 5}, seed=3), model),
        (program, Request("p0", params={"max_tokens": 2, "steps": 3}, seed=4), model),
        (denoise, Request("d2", params={"steps": 4}, seed=0), model),  # same seed as d0, different steps
    ]


def test_interleave_gate_holds_across_loops_programs_and_unit_kinds(model, denoise, decode):
    report = assert_interleave_parity(Engine, _mixed_items(model, denoise, decode))
    assert report.ok and report.max_abs == 0.0


def _reuse_items(model, denoise):
    return [(denoise, Request(f"r{i}", params={"steps": 6}, seed=i), model) for i in range(3)]


def test_gate_catches_interceptor_state_in_a_module_global(model, denoise):
    synthetic._LAST_PREDICTION.clear()
    with pytest.raises(AssertionError, match=r"interleave parity: max_abs=.*request #1 output 'latents'"):
        assert_interleave_parity(
            lambda: Engine(interceptors=[GlobalReuseInterceptor()]), _reuse_items(model, denoise)
        )


def test_gate_passes_interceptor_state_in_plugin_state(model, denoise):
    engine = lambda: Engine(interceptors=[PerRequestReuseInterceptor()])  # noqa: E731
    assert_interleave_parity(engine, _reuse_items(model, denoise))
    skipping = engine().run_one(denoise, Request("s", params={"steps": 6}), model)
    full = Engine().run_one(denoise, Request("s", params={"steps": 6}), model)
    assert not torch.equal(skipping.outputs["latents"], full.outputs["latents"])  # it really skips steps


def test_gate_needs_two_requests(model, denoise):
    with pytest.raises(ValueError, match="at least 2"):
        assert_interleave_parity(Engine(), _reuse_items(model, denoise)[:1])


def test_batched_parity_reports_the_max_difference(model, denoise, decode):
    items = _mixed_items(model, denoise, decode)
    report = check_batched_parity(Engine(), items, tol=1e-4)
    assert report.ok and 0.0 <= report.max_abs <= 1e-4 and "request #" in report.worst
    with pytest.raises(AssertionError, match="batched parity: max_abs="):
        check_batched_parity(Engine(), items, tol=-1.0)


class _Perturb:
    """Adds noise to one step's prediction: a bug the aligner must localise."""

    plugin_id = "perturb"

    def __init__(self, step: int) -> None:
        self.step = step

    def before(self, state, plan: WorkPlan) -> None:
        return None

    def after(self, state, plan: WorkPlan, result: StepResult) -> StepResult:
        if state.step == self.step:
            return StepResult({"v": result.outputs["v"] + 1e-3}, result.seconds)
        return result


def test_aligner_reports_the_first_divergence(model, denoise):
    aligner = ParityAligner(taps=["in.x", "out.v"], tolerances={"out.v": 1e-6})
    req = Request("r", params={"steps": 5}, seed=3)
    Engine(observers=[aligner]).run_one(denoise, req, model)
    aligner.replay()
    Engine(observers=[aligner]).run_one(denoise, req, model)
    assert aligner.first_divergence() is None and aligner.compared == 10
    aligner.replay()
    Engine(observers=[aligner], interceptors=[_Perturb(step=2)]).run_one(denoise, req, model)
    first = aligner.first_divergence()
    assert (first.step, first.tap) == (2, "out.v") and first.max_abs == pytest.approx(1e-3, rel=1e-3)
    assert "first: request 'r' loop 'denoise' step 2 tap 'out.v'" in aligner.report()


def test_compare_helpers():
    a = torch.tensor([1.0, 2.0, 4.0])
    b = torch.tensor([1.0, 2.5, 4.0])
    assert max_abs(a, b) == 0.5
    assert max_rel(a, b) == pytest.approx(0.125)
    assert psnr(a, a) == float("inf") and 10 < psnr(a, b) < 30
    with pytest.raises(ValueError, match="shape mismatch"):
        max_abs(a, b[:2])
