"""AsyncEngine: submit, stream, cancel, result; model work off the event loop."""

import asyncio
import threading

import pytest
import torch

from fv_core.errors import AdmissionInfeasible, Cancelled
from fv_core.request import Request
from fv_core.runtime import AsyncEngine, Budget, Engine
from tests.runtime.synthetic import DenoiseLoop


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
            with pytest.raises(AdmissionInfeasible):
                await aengine.submit(loop, Request("huge", params={"steps": 5000}), model)
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
