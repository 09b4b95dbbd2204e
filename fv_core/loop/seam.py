"""The runtime side of the interceptor seam: block hooks, the chain check, capability negotiation.

A block-structured step body declares that an interceptor may drive its
blocks by carrying ``inputs[BLOCKS_INPUT] = None``. When a block interceptor
is enabled, the runner replaces that ``None`` with a :class:`BlockHook` bound
to this request and, once the step is done, commits what the hook wrote back
into ``LoopState.plugin_state``. The body itself never touches LoopState: a
body that fails leaves the state as it was.

A plan keeps its batch key when its interceptor is a span interceptor
(``begin_span`` / ``skip_span`` / ``end_span``, see ``fv_core.extend``) and it
runs in one process: batched plans then reach the body as one
:class:`~fv_core.loop.spans.BlockHooks` (each plan's own hook over its rows), and
:func:`~fv_core.loop.spans.drive_spans` runs every block once for exactly the
rows that need it. Plans on a parallel group still run unbatched.

A block-causal loop (chunks attending to a KV cache of earlier chunks) offers its cached context to
a KV policy interceptor (kind ``kv_policy``) the same way: its chunk plans carry
``inputs[KV_INPUT] = None`` and the runner lets the policy ``attach`` itself (see
``fv_core.extend.KVPolicy``).

It lives with the loop runner that applies it; ``fv_core.extend`` (the plugin-facing
protocols) re-exports its public names, so ``extend`` depends on ``loop`` and never back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from fv_core.errors import ConfigError
from fv_core.loop.contracts import LoopState, WorkPlan
from fv_core.loop.spans import BlockHooks, drive_spans

BLOCKS_INPUT = "blocks"  # plan input through which a block-structured body receives its BlockHook
STEP_SKIP, BLOCK_SKIP = "step_skip", "block_skip"  # interceptor kinds a card may accept
KV_POLICY = "kv_policy"  # interceptor kind that decides a block-causal loop's cached context
KV_INPUT = "kv_policy"  # plan input through which a block-causal body receives the request's KV policy
# what a card needs to take each kind (said when it refuses one)
KIND_NEEDS = {
    STEP_SKIP: "it skips whole denoise steps",
    BLOCK_SKIP: "it skips transformer blocks of a denoise step",
    KV_POLICY: "it decides the KV cache of a block-causal (chunk by chunk) loop",
}

# block(index, hidden) -> hidden: computes transformer block ``index`` for real. A body whose plans
# may batch with block hooks also takes ``block(index, hidden, rows)``: ``hidden`` then holds only the
# batch rows ``rows`` (a LongTensor), and the block uses those rows of its per-row inputs.
BlockFn = Callable[..., torch.Tensor]


@dataclass(slots=True)
class BlockHook:
    """One plan's handle on the request's block interceptor.

    ``caches`` starts as a one-level copy of ``plugin_state[plugin_id]`` (key ->
    dict: one per CFG branch, plus whatever request-wide dicts the
    interceptor keeps); the interceptor rebinds keys of these dicts (never
    mutating tensors or nested values in place) and the runner commits them
    after the step.
    """

    interceptor: Any  # a BlockInterceptor (fv_core.extend.BlockInterceptor)
    caches: dict[str, dict[str, Any]] = field(default_factory=dict)  # working copy of the plugin's state

    def run(self, branch: str, hidden: torch.Tensor, num_blocks: int, block: BlockFn) -> torch.Tensor:
        """Blocks ``0..num_blocks-1`` of one forward of CFG ``branch``, as the interceptor decides."""
        return self.interceptor.run_blocks(self.caches, branch, hidden, num_blocks, block)


def drive_blocks(
    hook: BlockHook | BlockHooks | None,
    branch: str,
    hidden: torch.Tensor,
    num_blocks: int,
    block: BlockFn,
) -> torch.Tensor:
    """What a body calls for its block loop: through the hook(s) when attached, plainly otherwise."""
    if isinstance(hook, BlockHooks):
        return drive_spans(hook, branch, hidden, num_blocks, block)
    if hook is not None:
        return hook.run(branch, hidden, num_blocks, block)
    for index in range(num_blocks):
        hidden = block(index, hidden)
    return hidden


def is_block_interceptor(icp: Any) -> bool:
    return callable(getattr(icp, "run_blocks", None))


def is_span_interceptor(icp: Any) -> bool:
    """Whether ``icp`` can decide per request inside a batch (``begin_span``/``skip_span``/``end_span``)."""
    return all(callable(getattr(icp, name, None)) for name in ("begin_span", "skip_span", "end_span"))


def attach_block_hook(state: LoopState, plan: WorkPlan, interceptors: Sequence[Any]) -> WorkPlan:
    """``plan`` with a BlockHook in its ``BLOCKS_INPUT`` when a block interceptor is on. The plan keeps
    its batch key only when the interceptor is a span interceptor and the plan runs in one process."""
    icp = next((i for i in interceptors if is_block_interceptor(i)), None)
    if icp is None or BLOCKS_INPUT not in plan.inputs:
        return plan
    own = state.plugin_state.get(icp.plugin_id, {})
    hook = BlockHook(icp, {key: dict(value) for key, value in own.items()})
    key = plan.batch_key
    batchable = key is not None and key.parallel_plan == "single" and is_span_interceptor(icp)
    return replace(plan, inputs={**plan.inputs, BLOCKS_INPUT: hook}, batch_key=key if batchable else None)


def attach_kv_policy(state: LoopState, plan: WorkPlan, interceptors: Sequence[Any]) -> WorkPlan:
    """``plan`` as the request's KV policy attaches to it, when one is on and the plan offers its cache."""
    icp = next((i for i in interceptors if getattr(i, "kind", None) == KV_POLICY), None)
    if icp is None or KV_INPUT not in plan.inputs:
        return plan
    return icp.attach(state, plan)


def commit_block_hook(state: LoopState, plan: WorkPlan) -> None:
    """Fold what the plan's hook wrote back into ``state.plugin_state`` (a no-op when the body did not run)."""
    hook = plan.inputs.get(BLOCKS_INPUT)
    if isinstance(hook, BlockHook):
        state.plugin_state.setdefault(hook.interceptor.plugin_id, {}).update(hook.caches)


def interceptor_name(icp: Any) -> str:
    return str(getattr(icp, "name", None) or getattr(icp, "plugin_id", type(icp).__name__))


def check_interceptors(interceptors: Sequence[Any]) -> None:
    """At most one step-skipping, one block-skipping and one KV policy interceptor per loop."""
    for kind in KIND_NEEDS:
        names = [interceptor_name(i) for i in interceptors if getattr(i, "kind", None) == kind]
        if len(names) > 1:
            raise ConfigError(
                f"interceptors {names} are all {kind!r}; a loop takes at most one {kind} interceptor, "
                f"since each would decide alone what to skip. Fix: enable only one of them."
            )


def negotiate(card: Any, interceptors: Sequence[Any]) -> None:
    """Raise ConfigError when ``card`` does not accept the kind of one of ``interceptors``."""
    accepted = set(card.capabilities.interceptors)
    for icp in interceptors:
        kind = getattr(icp, "kind", None)
        if kind in KIND_NEEDS and kind not in accepted:
            raise ConfigError(
                f"card {card.model_id!r} rejects interceptor {interceptor_name(icp)!r} (a {kind} interceptor: "
                f"{KIND_NEEDS[kind]}; recipe {card.recipe.method!r}): it accepts {sorted(accepted) or 'none'}. "
                f"Fix: disable {interceptor_name(icp)!r} for this model."
            )
