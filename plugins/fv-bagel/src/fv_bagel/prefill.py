"""What BAGEL's loops share: the prefill plan of a context segment (a text or an understanding image)
and plans on the request's pinned weights.

Weight sync: a request pins the instance's weights versions (``net``, ``vae``) at init
(:func:`fv_core.loop.pinned_state`), ``think-t2i``'s denoise stage those its AR stage pinned
(``Request.carry``), and runs every plan (prefills, token steps, denoise rows, the VAE) on those modules.
The versions are part of the batch keys, so requests on old and new weights never share a call, and
keys/values are read only under the ``net`` version that wrote them: contexts handed to a later stage
name it, and a stage pinned to another version refuses them.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from fv_bagel import bodies
from fv_bagel.context import RAGGED_CONTEXT, plan_inputs
from fv_bagel.model import BagelModel
from fv_core.loop import BatchKey, LoopState, WorkPlan, WorkUnitKind, batch_key, pinned_module


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
                inputs=plan_inputs([ctx], ids=ids, pos=pos),
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
