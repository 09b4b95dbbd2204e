"""Cost-aware routing to fv workers behind Dynamo: each request goes to the worker instance whose engine
holds the fewest predicted seconds of work.

Dynamo 1.4.2's frontend routes round-robin, at random or by KV-cache overlap (LLM tokens); none reads fv's
cost model. ``CostRouter`` is a Dynamo client that does: before a request it asks every instance's live
``routing`` endpoint for its ``load`` (``export.backlog``: the predicted seconds the worker's calibrated
cost model gives the work it holds), adds the requests it sent there that the worker had not taken in yet
(at that worker's mean seconds per held request), and sends the request to the least loaded instance with
``Client.direct``. The choices are made one at a time against what this router has sent, so a burst
spreads instead of landing on one idle worker. A worker answers its load at its engine's next step
boundary, so a request waits up to one step of each busy worker before it is sent::

    router = await CostRouter.connect(runtime, "fv", "wan2.1-t2v-tiny")
    async for answer in router.send({"model": ..., "prompt": ..., "nvext": {"num_frames": 9}}): ...

A router's requests reach the worker whole (no frontend in between). Through Dynamo's HTTP frontend only
OpenAI's fields and Dynamo's typed ``nvext`` survive: ``frontend_body`` builds that body from an fv
request and refuses, naming the field and the fix, one whose field the frontend would drop.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fv_core import ConfigError
from fv_dynamo.worker import slug

# what Dynamo 1.4.2's frontend keeps of a request (NvCreateVideoRequest, the images request, their typed
# NvExt; measured: any other field, top level or in nvext, never reaches the worker)
KEPT = {
    "videos": {
        "top": {"model", "prompt", "size", "seconds", "input_reference", "response_format", "output_format", "user"},
        "nvext": {"seed", "negative_prompt", "num_inference_steps", "guidance_scale", "guidance_scale_2", "fps",
                  "num_frames", "boundary_ratio", "annotations"},
    },
    "images": {
        "top": {"model", "prompt", "n", "size", "response_format", "quality", "style", "user", "background",
                "moderation", "output_compression", "output_format", "partial_images"},
        "nvext": {"seed", "negative_prompt", "num_inference_steps", "guidance_scale", "annotations"},
    },
}  # fmt: skip


def frontend_body(request: dict[str, Any], kind: str = "videos") -> dict[str, Any]:
    """An fv request (fv's params at the top level or in ``nvext``) as the body Dynamo's frontend keeps:
    OpenAI's fields on top, fv's params in ``nvext``; a ConfigError names a field the frontend would drop."""
    kept, body, ext = KEPT[kind], {}, dict(request.get("nvext") or {})
    for field, value in request.items():
        if field in kept["top"]:
            body[field] = value
        elif field != "nvext":
            ext[field] = value
    lost = sorted(set(ext) - kept["nvext"])
    if lost:
        raise ConfigError(
            f"{', '.join(map(repr, lost))}: Dynamo's frontend drops these fields of a {kind} request (it keeps "
            f"OpenAI's fields and nvext's {sorted(kept['nvext'])}), so the model would run without them. "
            "Fix: send the request through fv_dynamo.CostRouter or the worker's own fv server, or leave them out."
        )
    return {**body, "nvext": ext} if ext else body


class CostRouter:
    """Routes one served model's requests (or a workflow's) by the predicted seconds each worker holds."""

    def __init__(self, requests: Any, routing: Any) -> None:
        self.requests, self.routing = requests, routing
        self.sent: dict[int, int] = {}  # instance -> requests sent and not answered yet

    @classmethod
    async def connect(cls, runtime: Any, namespace: str, model: str, endpoint: str = "videos") -> CostRouter:
        """A router for ``model``'s ``endpoint`` (``videos``, or ``generate`` for images and chat)."""
        prefix = f"{namespace}.{slug(model)}"
        requests = await runtime.endpoint(f"{prefix}.{endpoint}").client()
        routing = await runtime.endpoint(f"{prefix}.routing").client()
        await asyncio.gather(requests.wait_for_instances(), routing.wait_for_instances())
        return cls(requests, routing)

    async def loads(self) -> dict[int, dict[str, float]]:
        """Instance -> its live ``load`` (predicted queued seconds, requests held, jobs)."""
        ids = sorted(set(self.requests.instance_ids()) & set(self.routing.instance_ids()))

        async def one(instance: int) -> dict[str, float]:
            async for answer in await self.routing.direct({}, instance):
                return dict(answer.data()["load"])
            raise RuntimeError(f"instance {instance} answered no routing card")

        return dict(zip(ids, await asyncio.gather(*(one(i) for i in ids)), strict=True))

    async def pick(self) -> int:
        """The instance with the least predicted seconds, counting requests it has not taken in yet."""
        return self._least(await self.loads())

    def _least(self, loads: dict[int, dict[str, float]]) -> int:
        if not loads:
            raise RuntimeError("no fv worker instance is registered for this model")

        def predicted(instance: int) -> tuple[float, int]:
            load, sent = loads[instance], self.sent.get(instance, 0)
            per_request = load["queued_s"] / load["requests"] if load["requests"] else 0.0
            unseen = max(0, sent - int(load["queue_depth"]))
            return load["queued_s"] + unseen * per_request, sent

        return min(loads, key=predicted)

    async def send(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """The worker's answers to ``request``, from the instance ``pick`` chose."""
        instance = self._least(await self.loads())  # concurrent requests ask at once; each choice is atomic
        self.sent[instance] = self.sent.get(instance, 0) + 1
        try:
            async for answer in await self.requests.direct(request, instance):
                yield answer.data()
        finally:
            self.sent[instance] -= 1
