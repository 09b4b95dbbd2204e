"""What BAGEL's loops share: the prefill plan of a context segment (a text or an understanding image)
and plans on the request's pinned weights.

Weight sync: a request pins the instance's weights versions (``net``, ``vae``) at init
(:func:`fv_core.loop.pinned_state`), ``think-t2i``'s denoise stage those its AR stage pinned
(``Request.carry``), and runs every plan (prefills, token steps, denoise rows, the VAE) on those modules.
The versions are part of the batch keys, so requests on old and new weights never share a call, and
keys/values are read only under the ``net`` version that wrote them: contexts handed to a later stage
name it, and a stage pinned to another version refuses them.

Prefix caching: a context's pages are recorded in the instance's prefix cache (:mod:`fv_core.kv.prefix`)
under its tokens' keys (a text token: its id; an image's tokens: its content hash and their index) in a
namespace of the pinned ``net`` version and the request's adapters. A new context starts from the longest
cached prefix of its segments: segments served whole are not prefilled, a text segment served in part is
prefilled from its first token the cache did not hold (an image is served whole or not at all: its tokens
attend to each other). Greedy outputs do not change (bit for bit on the row-invariant path). The pages
reused are reserved on the pool when they are taken (at init, before admission: a waiting request holds
them), so ``kv_need`` asks admission only for the rest, and ``release`` gives the reservation back.
"""

from __future__ import annotations

import hashlib
from functools import partial
from typing import Any

import torch

from fv_bagel import bodies
from fv_bagel.context import RAGGED_CONTEXT, plan_inputs
from fv_bagel.model import BagelModel
from fv_core.adapters import adapter_tag
from fv_core.kv import KVSeq
from fv_core.loop import BatchKey, LoopState, WorkPlan, WorkUnitKind, batch_key, pinned, pinned_module

Served = tuple[KVSeq, int, list[Any], list[dict[str, Any]], list[tuple[int, int]]]


class PrefillLoop:
    """Base of BAGEL's loops over one instance."""

    def __init__(self, instance: BagelModel) -> None:
        self.instance = instance

    def _key(self, state: LoopState, kind: str, shape: tuple, component: str = "net") -> BatchKey:
        """Batch key of a plan on the request's pinned ``component`` (the exact instance's own graph)."""
        inst = self.instance
        graph = "exact" if inst.exact else ""
        return batch_key(inst, state, component, kind, shape, inst.precision, graph_key=graph)

    def _net(self, state: LoopState) -> Any:
        return pinned_module(self.instance, state, "net")

    def _segment_plan(self, ctx: dict[str, Any], segment: dict[str, Any], state: LoopState) -> WorkPlan:
        """The prefill WorkUnit of one context segment (a text or an understanding image)."""
        inst = self.instance
        net = self._net(state)
        dev = inst.device
        if segment["kind"] == "text":
            ids = torch.tensor([segment["ids"]], device=dev)
            pos = ctx["rope"] + torch.arange(ids.shape[1], device=dev)[None]
            return WorkPlan(
                kind=WorkUnitKind.AR_PREFILL,
                body=partial(bodies.text_body, net, inst.exact, True),
                inputs=plan_inputs(
                    [ctx], ids=ids, pos=pos, last=torch.tensor([ids.shape[1] - 1], device=dev)
                ),
                # texts of any lengths share a call: each row's block padded at its end (causal: its
                # tokens never see the padding; advance keeps only its own tokens' keys/values)
                batch_key=self._key(state, "ar_prefill", ()),
                ragged={"ids": 1, "pos": 1, **RAGGED_CONTEXT},
                label=f"prefill {ids.shape[1]} tokens",
            )
        patches = state.tensors[f"image{segment['index']}.patches"]
        vit = state.tensors[f"image{segment['index']}.ids"]
        sp = inst.special
        ids = torch.tensor([[sp["start_of_image"], sp["end_of_image"]]], device=dev)
        pos = torch.full((1, patches.shape[0] + 2), ctx["rope"], device=dev)
        return WorkPlan(
            kind=WorkUnitKind.ENCODER_CHUNK,
            body=partial(bodies.vit_body, net, inst.exact),
            inputs=plan_inputs([ctx], ids=ids, pos=pos, patches=patches[None], vit_ids=vit[None]),
            label=f"image {patches.shape[0]} ViT tokens",
        )

    def _tokens(self, state: LoopState, segment: dict[str, Any]) -> int:
        """Tokens a segment writes to its context (an image: its tokens between the two vision markers)."""
        if segment["kind"] == "text":
            return len(segment["ids"])
        return 2 + len(state.tensors[f"image{segment['index']}.ids"])

    def _namespace(self, state: LoopState) -> str:
        """What besides the tokens makes a context's keys/values: the net version and the adapters on it."""
        return f"{pinned(state, 'net')}|{adapter_tag(state, 'net')}"

    def _keys(self, state: LoopState, segment: dict[str, Any]) -> list[Any] | None:
        """The prefix-cache keys of a segment's tokens (None: a segment the cache does not hold)."""
        if segment["kind"] == "text":
            return list(segment["ids"])
        if segment["kind"] != "image":
            return None
        digest = hashlib.sha256()
        for name in ("patches", "ids"):
            digest.update(state.tensors[f"image{segment['index']}.{name}"].detach().cpu().numpy().tobytes())
        tag = digest.hexdigest()[:32]
        return [f"{tag}:{i}" for i in range(self._tokens(state, segment))]

    def _segment_keys(self, state: LoopState, segments: list[dict[str, Any]]) -> list[list[Any]]:
        """The prefix-cache keys of each leading segment the cache can hold."""
        keys = []
        for segment in segments:
            segment_keys = self._keys(state, segment)
            if segment_keys is None:
                break
            keys.append(segment_keys)
        return keys

    def _served(self, state: LoopState, segments: list[dict[str, Any]], reserve: bool = True) -> Served:
        """The longest prefix of ``segments`` the prefix cache holds: the context over its pages, its next
        RoPE position, its tokens' keys, the segments left to prefill (a text served in part: its rest) and
        the context's (length, RoPE position) after each segment served whole. ``reserve``: promise the
        pages reused on the pool (False: admission already counted them as the request's own)."""
        cache, keys = self.instance.prefix, self._segment_keys(state, segments)
        flat = [k for segment_keys in keys for k in segment_keys]
        if cache is None or not flat:
            return KVSeq(), 0, [], list(segments), []
        pool, seq = self.instance.kv_pool, cache.lookup(self._namespace(state), flat)
        served, rope, left, ends = 0, 0, list(segments), []
        for segment, segment_keys in zip(segments, keys, strict=False):
            n, text = len(segment_keys), segment["kind"] == "text"
            if served + n <= seq.length:
                served, rope = served + n, rope + (n if text else 1)
                ends.append((served, rope))
                left.pop(0)
                continue
            if text and served < seq.length:  # prefill the rest of the text only
                cut = seq.length - served
                left[0] = {"kind": "text", "ids": segment["ids"][cut:]}
                served, rope = seq.length, rope + cut
            break
        # a match shorter than a page (or the whole context) saves little and would pin another's page;
        # the pages reused are promised now (admission reserves the rest): they are held from here on
        if served < min(pool.page_size, len(flat)) or (reserve and not pool.reserve(pool.pages_for(served))):
            pool.release(seq)
            return KVSeq(), 0, [], list(segments), []
        return pool.truncate(seq, served), rope, flat[:served], left, ends

    def _remember(self, state: LoopState, keys: list[Any], seq: dict[str, Any]) -> None:
        """Record a context's pages in the prefix cache under its tokens' keys."""
        cache = self.instance.prefix
        if cache is not None and keys:
            cache.insert(self._namespace(state), keys, KVSeq(**seq))
