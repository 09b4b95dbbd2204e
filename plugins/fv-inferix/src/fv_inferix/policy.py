"""The ``inferix`` KV policy: local + retrieved global blocks, relevance-based eviction under the budget.

Per request (its options in ``plugin_state["fv-inferix"]``):

- **attend**: every layer of a new block's passes attends to the sink blocks, the ``local_blocks`` most
  recent cached blocks and the ``global_blocks`` other cached blocks most relevant to its queries
  (:mod:`fv_inferix.retrieve`);
- **evict**: when a finished block is written and the cache would pass the request's budget
  (``window_frames``), the blocks with the least decayed relevance leave (never a sink nor one of the
  ``local_blocks - 1`` newest, which the next block attends to with the new one); their pages return
  to the pool;
- **profile**: seconds per block, cache bytes while each block was made, context tokens attended,
  retrievals by block age and the evicted blocks, in ``result.metrics["kv_policy"]`` (and ``/metrics``).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, ClassVar

import torch
from pydantic import ValidationError

from fv_core import ConfigError, explain
from fv_core.extend import KV_INPUT, KV_POLICY
from fv_core.loop import LoopResult, LoopState, StepResult, WorkPlan
from fv_inferix.options import PLUGIN, InferixOptions
from fv_inferix.retrieve import Selector


class Inferix:
    """The ``inferix`` interceptor (kind ``kv_policy``): one instance serves every request of a model."""

    plugin_id: ClassVar[str] = PLUGIN
    kind: ClassVar[str] = KV_POLICY
    name: ClassVar[str] = "inferix"

    def __init__(self, **options: Any) -> None:
        """``options``: this interceptor's defaults; a deployment's and a request's reach each request
        through ``request.options``."""
        try:
            self.options = InferixOptions(**options)
        except ValidationError as exc:
            raise ConfigError(
                explain(exc, f"interceptor {self.name!r}", InferixOptions.model_fields)
            ) from None

    def _options(self, request: Any) -> InferixOptions:
        asked = request.options.get(PLUGIN) if request.options else None
        update = asked.model_dump(include=asked.model_fields_set) if asked is not None else {}
        return self.options.model_copy(update=update)

    def check_request(self, request: Any, instance: Any) -> None:
        """Refuse, before the request is queued, a budget that cannot hold the sinks, the local blocks
        and the incoming block."""
        opts, p = self._options(request), request.params
        chunk = getattr(p, "chunk_frames", None)
        if not opts.enabled or chunk is None:
            return
        sinks = -(-p.sink_frames // chunk)
        need = (sinks + opts.local_blocks) * chunk
        if need > p.window_frames:
            raise ConfigError(
                f"fv-inferix: window_frames={p.window_frames} (the cache's budget) cannot hold {sinks} sink "
                f"block(s) and local_blocks={opts.local_blocks} of chunk_frames={chunk} (the newest cached blocks "
                f"plus the incoming one): it needs {need} frames. Fix: raise window_frames to >= {need} or lower "
                "local_blocks.",
                param="plugin_options",
            )

    def on_start(self, state: LoopState, request: Any) -> None:
        state.plugin_state[PLUGIN] = {
            "options": self._options(request).model_dump(),
            "relevance": {},  # block index (str) -> decayed relevance
            "pending_s": 0.0,  # seconds of the block being made so far
            "block_seconds": [],
            "cache_bytes": [],  # bytes the cache held while each block was made
            "attended_tokens": [],  # context tokens a layer attended, per block (mean over its passes)
            "retrieved_by_age": {},  # blocks back from the newest cached one -> retrievals (layer x pass)
            "evicted_blocks": [],
            "passes": 0,
            "attended_sum": 0.0,
        }

    # ---- the seam ----

    def attach(self, state: LoopState, plan: WorkPlan) -> WorkPlan:
        """The plan with this policy and the request's kept slots and retrieval count in its inputs."""
        opts = InferixOptions(**state.plugin_state[PLUGIN]["options"])
        blocks = plan.inputs["kv_blocks"][0]
        present = blocks >= 0
        if opts.enabled:
            local = torch.zeros_like(present)
            count = int(present.sum())
            local[max(count - opts.local_blocks, 0) : count] = True
            keep, top = plan.inputs["kv_sinks"][0] | local, opts.global_blocks
        else:
            keep, top = present, -1
        key = plan.batch_key
        if key is not None:  # rows batch only with rows that run this policy
            key = replace(key, graph_key=f"{key.graph_key}|kv:{PLUGIN}")
        top_row = torch.tensor([top], device=blocks.device)
        inputs = {**plan.inputs, KV_INPUT: self, "kv_keep": keep[None], "kv_top": top_row}
        return replace(plan, inputs=inputs, batch_key=key)

    def selector(self, inputs: dict[str, Any]) -> Selector:
        return Selector(inputs)

    def after(self, state: LoopState, plan: WorkPlan, result: StepResult) -> StepResult:
        """Fold a chunk pass's retrieval into the request's statistics; on a cache write, choose the
        blocks that leave."""
        if plan.inputs.get(KV_INPUT) is not self or "kv_relevance" not in result.outputs:
            return result
        own = state.plugin_state[PLUGIN]
        opts = InferixOptions(**own["options"])
        blocks = plan.inputs["kv_blocks"][0].tolist()
        self._fold(own, plan, result, blocks, opts.relevance_decay)
        room = int(plan.inputs["kv_room"][0])
        if room < 0:  # a denoise step
            return result
        own["block_seconds"] = [*own["block_seconds"], own["pending_s"]]
        own["attended_tokens"] = [*own["attended_tokens"], own["attended_sum"] / max(own["passes"], 1)]
        own.update(pending_s=0.0, passes=0, attended_sum=0.0)
        if opts.enabled:
            evict = choose_evictions(plan.inputs, own["relevance"], room, opts.local_blocks)
            own["evicted_blocks"] = [*own["evicted_blocks"], *evict]
            own["relevance"] = {b: r for b, r in own["relevance"].items() if int(b) not in evict}
            result.outputs["kv_evict"] = evict
        return result

    @staticmethod
    def _fold(
        own: dict[str, Any], plan: WorkPlan, result: StepResult, blocks: list[int], decay: float
    ) -> None:
        out, inputs = result.outputs, plan.inputs
        if own["passes"] == 0:  # the block's first pass: what the cache holds while it is made
            _, layers, heads, _, dim = inputs["ctx_k"].shape
            per_token = 2 * layers * heads * dim * inputs["ctx_k"].element_size()
            own["cache_bytes"] = [*own["cache_bytes"], int((inputs["kv_slots"] >= 0).sum()) * per_token]
        own["passes"] += 1
        own["pending_s"] += result.seconds
        own["attended_sum"] += float(out["kv_attended"][0])
        relevance = dict(own["relevance"])
        for b in relevance:
            relevance[b] *= decay
        newest = max(blocks, default=-1)
        ages = dict(own["retrieved_by_age"])
        shares, picks = out["kv_relevance"][0].tolist(), out["kv_picked"][0].tolist()
        for block, share, picked in zip(blocks, shares, picks, strict=True):
            if block < 0:
                continue
            relevance[str(block)] = relevance.get(str(block), 0.0) + share
            if picked:
                age = str(newest - block)
                ages[age] = ages.get(age, 0) + int(picked)
        own["relevance"], own["retrieved_by_age"] = relevance, ages

    def on_finish(self, state: LoopState, result: LoopResult) -> None:
        own = state.plugin_state.get(PLUGIN)
        if not own:
            return
        seconds, attended = list(own["block_seconds"]), list(own["attended_tokens"])
        if own["passes"]:  # the last block is not written (unless a session keeps it)
            seconds.append(own["pending_s"])
            attended.append(own["attended_sum"] / own["passes"])
        result.metrics["kv_policy"] = {
            "policy": self.name,
            "enabled": own["options"]["enabled"],
            "options": own["options"],
            "blocks": len(seconds),
            "block_seconds": [round(s, 6) for s in seconds],
            "cache_bytes": list(own["cache_bytes"]),
            "peak_cache_bytes": max(own["cache_bytes"], default=0),
            "attended_tokens": [round(a, 2) for a in attended],
            "retrievals": sum(own["retrieved_by_age"].values()),
            "retrieved_by_age": dict(sorted(own["retrieved_by_age"].items(), key=lambda kv: int(kv[0]))),
            "evicted_blocks": list(own["evicted_blocks"]),
        }


def choose_evictions(
    inputs: dict[str, Any], relevance: dict[str, float], room: int, local_blocks: int
) -> list[int]:
    """Blocks to drop so that ``room`` frames leave the cache: the least relevant first (the older on a
    tie), never a sink nor one of the ``local_blocks - 1`` newest."""
    blocks = inputs["kv_blocks"][0].tolist()
    frames = inputs["kv_frames"][0].tolist()
    sinks = inputs["kv_sinks"][0].tolist()
    cached = [i for i, b in enumerate(blocks) if b >= 0]
    protected = set(cached[len(cached) - (local_blocks - 1) :]) if local_blocks > 1 else set()
    candidates = [i for i in cached if not sinks[i] and i not in protected]
    candidates.sort(key=lambda i: (relevance.get(str(blocks[i]), -math.inf), blocks[i]))
    evict, freed = [], 0
    for i in candidates:
        if freed >= room:
            break
        evict.append(blocks[i])
        freed += frames[i]
    return evict
