"""Out of memory inside a step: a batch is split and its rows retried alone, only a row that fails alone
fails (with the numbers), nothing leaks, the engine keeps serving; a request that can never fit the memory
budget is refused at submission."""

import pytest
import torch

from fv_core.deploy.card import Scheduling
from fv_core.errors import AdmissionInfeasible
from fv_core.request import Request
from fv_core.runtime import Budget, Engine, OutOfMemory, SchedulingPolicy
from fv_core.runtime.admission import resident_bytes
from tests.runtime.synthetic import DenoiseLoop

ZERO = {"compute_s": 0.0, "memory_bytes": 0, "running": 0}
POISON = 7.0  # the guidance that marks the row whose memory runs out


class OomDenoise(DenoiseLoop):
    """A device that holds ``max_rows`` rows per call; the poisoned row does not fit in a batch (``alone``:
    not even alone). The error is raised from the body, where a real allocation fails."""

    def __init__(self, model, max_rows: int, alone: bool, error: type[BaseException]) -> None:
        super().__init__(model)
        self.max_rows, self.alone, self.error = max_rows, alone, error
        self.calls: list[int] = []  # rows of every body call tried

    def denoise_body(self, inputs):
        rows, poisoned = inputs["x"].shape[0], bool((inputs["g"] == POISON).any())
        self.calls.append(rows)
        if rows > self.max_rows or (poisoned and (rows > 1 or self.alone)):
            raise self.error(f"injected: {rows} rows do not fit")
        return super().denoise_body(inputs)


def items(loop, model, poison_at: int = 1):
    return [
        (
            loop,
            Request(f"r{i}", params={"steps": 3, "guidance": POISON if i == poison_at else 3.0}, seed=i),
            model,
        )
        for i in range(4)
    ]


@pytest.mark.parametrize("policy", ["fair", "auto"])
def test_four_rows_oom_on_the_second_are_split_and_each_completes_bitwise_equal_to_its_solo_run(
    model, policy
):
    loop = OomDenoise(model, max_rows=1, alone=False, error=torch.OutOfMemoryError)  # one row fits
    engine = Engine(scheduling=SchedulingPolicy(policy))
    results = engine.run_batched(items(loop, model))
    if policy == "fair":
        assert loop.calls[:5] == [4, 1, 1, 1, 1]  # the 4-row call failed, then each row alone
    else:
        assert loop.calls[:3] == [2, 1, 1]  # auto probes two rows: they fail, then each alone
    solo = Engine().run_serial(items(DenoiseLoop(model), model))
    for got, want in zip(results, solo, strict=True):
        assert torch.equal(got.outputs["latents"], want.outputs["latents"])
    assert engine.decisions.split >= 1 and engine.admission.usage() == ZERO


@pytest.mark.parametrize("error", [torch.OutOfMemoryError, MemoryError])
def test_a_row_that_runs_out_of_memory_alone_fails_alone_with_the_numbers(model, error):
    loop = OomDenoise(model, max_rows=1, alone=True, error=error)
    engine = Engine(Budget(memory_bytes=1 << 30))
    events = []
    engine.on_event = lambda e: e.kind in ("done", "error") and events.append((e.request_id, e.kind, e.data))
    with pytest.raises(OutOfMemory) as err:
        engine.run_batched(items(loop, model))
    message = str(err.value)
    assert message.startswith(
        "out_of_memory: request 'r1' ran out of memory in 'denoise 1/3' run alone after "
    )
    assert (
        "batch of 4 rows" in message
        and "predicted peak 32768 bytes, memory budget 1073741824 bytes" in message
    )
    assert "Fix: ask for a smaller shape" in message and err.value.code == "out_of_memory"
    assert isinstance(err.value, MemoryError)
    finished = {rid: kind for rid, kind, _ in events}
    assert finished == {"r0": "done", "r1": "error", "r2": "done", "r3": "done"}
    solo = Engine().run_serial(items(DenoiseLoop(model), model))
    for (rid, kind, data), want in zip(sorted(events), solo, strict=True):
        if kind == "done":
            assert torch.equal(data.outputs["latents"], want.outputs["latents"]), rid
    assert engine.admission.usage() == ZERO  # nothing reserved is left behind
    engine.run_one(loop, Request("after", params={"steps": 2}), model)  # and the engine keeps serving


def test_a_lone_request_out_of_memory_fails_only_itself(model):
    loop = OomDenoise(model, max_rows=1, alone=True, error=torch.OutOfMemoryError)
    engine = Engine()
    with pytest.raises(
        OutOfMemory, match=r"request 'r1' ran out of memory in 'denoise 1/3' run alone \(1 row"
    ):
        engine.run_one(*items(loop, model)[1])
    assert engine.admission.usage() == ZERO
    assert engine.run_one(*items(loop, model)[0]).outputs["latents"].shape == (1, 8, 16)


def test_a_request_that_can_never_fit_the_memory_budget_is_refused_at_submission(model, denoise):
    weights = resident_bytes(model)
    scheduling = Scheduling(policy="auto", memory_budget_bytes=weights + 1000)  # a deploy file's section
    engine = Engine(scheduling=scheduling)
    assert engine.admission.budget.memory_bytes == weights + 1000 and engine.policy.policy == "auto"
    with pytest.raises(AdmissionInfeasible) as err:
        engine.run_one(denoise, Request("big"), model)
    assert str(err.value) == (
        f"request 'big': predicted memory needs {weights} resident + 32768 peak = {weights + 32768} bytes but "
        f"the memory budget is {weights + 1000} bytes, so it can never run. Fix: use a smaller shape (fewer "
        "frames, lower resolution), or raise the budget (a deploy file's scheduling.memory_budget_bytes; "
        "Budget.memory_bytes)"
    )
    assert engine.admission.usage() == ZERO
