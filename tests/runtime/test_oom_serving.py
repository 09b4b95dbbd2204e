"""Out of memory through a real server: a request that runs out of memory alone answers HTTP 507 with code
``out_of_memory`` and the numbers; a batch that runs out of memory is split and its requests complete; the
server keeps serving. The device's limit is injected where a real allocation fails: a forward pre-hook on
the loaded Wan transformer's patch embedding raises ``torch.OutOfMemoryError`` past a number of elements."""

from __future__ import annotations

import re

import httpx
import openai
import pytest
import torch

from fv_core.deploy.card import Scheduling
from tests.runtime.test_policy_serving import host, metric  # noqa: F401 (the module's fixture)
from tests.serving.support import TINY, ServerThread, tiny_deploy

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

IMAGE = {"model": TINY, "size": "32x32", "extra_body": {"num_inference_steps": 3, "seed": 1}}


class Device:
    """Holds ``limit`` elements of patch-embedding input per call (None: no limit yet, only measure)."""

    def __init__(self) -> None:
        self.limit: int | None = None
        self.seen: list[int] = []  # elements of every call's input

    def hook(self, module: torch.nn.Module, args: tuple) -> None:
        size = args[0].numel()
        self.seen.append(size)
        if self.limit is not None and size > self.limit:
            raise torch.OutOfMemoryError(f"injected: {size} elements do not fit in {self.limit}")


def test_out_of_memory_answers_507_with_the_numbers_and_a_split_batch_completes(host, tmp_path):  # noqa: F811
    deploy = tiny_deploy(tmp_path, determinism="batched")
    deploy.scheduling = Scheduling(policy="fair")  # time-sharing: two images' steps batch together
    device = Device()
    with ServerThread(deploy, host) as server:
        instance = server.service.models[TINY].loaded.instance
        instance.component("transformer").patch_embedding.register_forward_pre_hook(device.hook)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0, timeout=60)
        client.images.generate(prompt="a red flower", **IMAGE)
        device.limit = max(device.seen)  # one 32x32 image fits, two rows of it do not
        two = client.images.generate(prompt="a red flower", n=2, **IMAGE)
        assert len(two.data) == 2  # their batched steps ran out of memory, were split, and completed
        with pytest.raises(openai.APIStatusError) as err:
            client.images.generate(prompt="a red flower", **{**IMAGE, "size": "64x64"})
        after = client.images.generate(prompt="a blue flower", **IMAGE)  # the server keeps serving
        text = httpx.get(f"{server.url}/metrics").text
    assert err.value.status_code == 507
    body = err.value.body
    assert body["code"] == "out_of_memory" and body["type"] == "server_error", body
    assert re.search(
        r"^out_of_memory: request '\S+' ran out of memory in '.+' run alone \(\d+ row\(s\), predicted peak "
        r"\d+ bytes, memory budget \d+ bytes\): OutOfMemoryError: injected: \d+ elements do not fit in \d+\. "
        r"Fix: ask for a smaller shape",
        body["message"],
    ), body["message"]
    assert len(after.data) == 1
    assert metric(text, 'fv_schedule_decisions_total{decision="split"}') >= 1
