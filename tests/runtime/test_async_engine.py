"""AsyncEngine: submit, stream, cancel, result; model work off the event loop."""

import asyncio
import gc
import threading

import pytest
import torch

from fv_core.errors import AdmissionInfeasible, Cancelled
from fv_core.request import Request
from fv_core.runtime import AsyncEngine, Budget, Engine
from tests.runtime.synthetic import DenoiseLoop, NullLoop


class _ThreadProbe:
    plugin_id = "thread_probe"

    def __init__(self) -> None:
        self.threads: set[str] = set()

    def before(self, state, plan):
        self.threads.add(threading.current_thread().name)

    def after(self, state, plan, result):
        return result


def test_async_engine_streams_cancels_and_returns(model):
    probe = _ThreadProbe()
    loop = DenoiseLoop(model, sleep_s=0.002)

    async def main():
        async with AsyncEngine(Engine(Budget(compute_s=1.0), interceptors=[probe])) as aengine:
            ids = [
                await aengine.submit(loop, Request(f"r{i}", params={"steps": 5}, seed=i), model)
                for i in range(3)
            ]
            huge = await aengine.submit(
                loop, Request("huge", params={"steps": 5000}), model
            )  # answers at once
            with pytest.raises(AdmissionInfeasible):  # the worker refuses it: it ends with that error
                await aengine.result(huge)
            streamed = []
            async for event in aengine.stream("r0"):
                streamed.append((event.kind, event.step))
                if event.step == 1:
                    aengine.cancel("r1")
            results = [await aengine.result(ids[0]), await aengine.result(ids[2])]
            with pytest.raises(Cancelled):
                await aengine.result("r1")
            return streamed, results, aengine.engine.admission.usage()

    streamed, results, usage = asyncio.run(main())
    assert streamed == [("progress", i) for i in range(1, 6)] + [("done", 5)]
    assert usage["running"] == 0 and usage["compute_s"] == 0.0
    serial = Engine().run_one(loop, Request("r0", params={"steps": 5}, seed=0), model)
    assert torch.allclose(results[0].outputs["latents"], serial.outputs["latents"], atol=1e-5)  # batched
    assert probe.threads == {"fv-engine"}  # never the event loop's thread


def test_submit_answers_while_the_worker_is_busy(model):
    """A step that holds the worker until the test lets it go: the second submit must not wait for it."""
    release = threading.Event()

    class Stuck(DenoiseLoop):
        def next(self, state):
            plan = super().next(state)
            if state.request_id == "slow" and hasattr(plan, "body"):
                body = plan.body
                plan.body = lambda inputs: (release.wait(30), body(inputs))[1]
            return plan

    async def main():
        async with AsyncEngine(Engine()) as aengine:
            slow = await aengine.submit(Stuck(model), Request("slow", params={"steps": 2}), model)
            await asyncio.sleep(0.05)  # the worker is now inside the held step
            quick = await aengine.submit(DenoiseLoop(model), Request("quick", params={"steps": 2}), model)
            submitted_while_held = not release.is_set()
            release.set()
            await aengine.result(slow), await aengine.result(quick)
            return submitted_while_held

    assert asyncio.run(main())


def test_freeze_heap_on_start_leaves_the_loaded_heap_out_of_gc_scans(model):
    async def main():
        async with AsyncEngine(Engine(), freeze_heap=True) as aengine:
            rid = await aengine.submit(NullLoop(), Request("f", params={"steps": 2}), None)
            assert (await aengine.result(rid)).metrics["steps"] == 2
            return gc.get_freeze_count()

    try:
        assert asyncio.run(main()) > 1000  # torch and the test's objects were frozen at start
    finally:
        gc.unfreeze()


def test_engines_give_the_freed_heap_back_when_they_go_idle(model, monkeypatch):
    import fv_core.runtime.async_engine as async_engine_module
    import fv_core.runtime.engine as engine_module

    calls = []
    monkeypatch.setattr(engine_module, "release_heap", lambda: calls.append("engine"))
    monkeypatch.setattr(async_engine_module, "release_heap", lambda: calls.append("async"))
    Engine().run_one(NullLoop(), Request("e", params={"steps": 3}), None)
    assert calls == ["engine"]  # once, at the end of the run, not per step

    async def main():
        async with AsyncEngine(Engine()) as aengine:
            rid = await aengine.submit(NullLoop(), Request("a", params={"steps": 3}), None)
            await aengine.result(rid)

    asyncio.run(main())
    assert calls == ["engine", "async"]


def test_release_heap_runs_on_any_c_library():
    from fv_core.runtime.engine import release_heap

    release_heap()  # glibc trims; elsewhere a no-op
