"""Block hooks of a batch: every block runs once, for exactly the rows that need it.

A span interceptor (``begin_span`` / ``skip_span`` / ``end_span``) names, per
forward, one span of blocks ``[first, last)`` it may skip. For a batch of
plans, each with its own hook over its own rows::

    blocks before a row's span     run for it (batched with every other row that runs them)
    at its span's first block      its interceptor sees its rows' residual so far and answers:
                                   skip (its rows get the returned residual added) or compute
    blocks inside the span         run for the rows that compute, batched (index_select / index_copy)
    at its span's end              a computing row's interceptor records its span residual
    blocks after the span          run for it

A plan without a hook runs every block. Each interceptor reads and rebinds only
its own plan's ``caches``; the runner commits them per request as for a solo
plan. With one plan covering every row the operations are those of a solo
forward, so a span interceptor's ``run_blocks`` is ``drive_spans`` of itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from fv_core.adapters.rows import rows_subset

if TYPE_CHECKING:
    from fv_core.loop.seam import BlockHook


@dataclass(slots=True)
class BlockHooks:
    """The hooks of plans batched into one call: one per plan, over consecutive batch rows."""

    members: list[tuple[BlockHook | None, int]]  # each plan's hook (None: all its blocks run), its rows


@dataclass(slots=True)
class _Rows:
    """One plan's rows in one forward."""

    hook: BlockHook | None  # its hook (None: every block runs)
    rows: slice  # its rows of the batch
    first: int  # its span: blocks [first, last) may be skipped ...
    last: int
    skipped: bool = False  # ... and are, in this forward
    span_in: torch.Tensor | None = None  # its hidden rows entering the span, when it computes

    def runs(self, index: int) -> bool:
        return not (self.skipped and self.first <= index < self.last)


def drive_spans(
    hooks: BlockHooks, branch: str, hidden: torch.Tensor, num_blocks: int, block: Callable[..., torch.Tensor]
) -> torch.Tensor:
    """Blocks ``0..num_blocks-1`` of one forward of CFG ``branch`` for every plan of ``hooks``."""
    parts = _begin(hooks, branch, num_blocks)
    if sum(p.rows.stop - p.rows.start for p in parts) != hidden.shape[0]:
        raise ValueError(
            f"block hooks cover {[p.rows for p in parts]} but hidden has {hidden.shape[0]} rows; "
            "a batched body must pass every plan's rows, in plan order"
        )
    start = hidden
    for index in range(num_blocks + 1):
        hidden = _boundary(parts, branch, index, start, hidden)
        if index < num_blocks:
            hidden = _run(block, index, hidden, [p for p in parts if p.runs(index)], len(parts))
    return hidden


def _begin(hooks: BlockHooks, branch: str, num_blocks: int) -> list[_Rows]:
    parts, row = [], 0
    for hook, rows in hooks.members:
        first, last = num_blocks, num_blocks  # no hook: an empty span past the end, never skipped
        if hook is not None:
            first, last = hook.interceptor.begin_span(hook.caches, branch, num_blocks)
        parts.append(_Rows(hook, slice(row, row + rows), first, last))
        row += rows
    return parts


def _boundary(parts: list[_Rows], branch: str, index: int, start: torch.Tensor, hidden: torch.Tensor):
    """Decisions of the spans that start at ``index``, records of those that end there."""
    added: dict[int, torch.Tensor] = {}
    for n, p in enumerate(parts):
        if p.hook is None or p.first != index:
            continue
        mine = hidden[p.rows]
        residual = p.hook.interceptor.skip_span(p.hook.caches, branch, mine - start[p.rows])
        if residual is None:
            p.span_in = mine
        else:
            p.skipped, added[n] = True, mine + residual
    if added:
        hidden = _replace_rows(parts, hidden, added)
    for p in parts:
        if p.hook is not None and p.last == index and p.span_in is not None:
            p.hook.interceptor.end_span(p.hook.caches, branch, hidden[p.rows] - p.span_in)
    return hidden


def _replace_rows(parts: list[_Rows], hidden: torch.Tensor, new: dict[int, torch.Tensor]) -> torch.Tensor:
    if len(parts) == 1:
        return new[0]
    return torch.cat([new.get(n, hidden[p.rows]) for n, p in enumerate(parts)])


def _run(
    block: Callable[..., torch.Tensor], index: int, hidden: torch.Tensor, active: list[_Rows], total: int
):
    """Block ``index`` for the rows of ``active`` as one call (every row: the plain call)."""
    if not active:
        return hidden
    if len(active) == total:
        return block(index, hidden)
    rows = torch.cat([torch.arange(p.rows.start, p.rows.stop) for p in active]).to(hidden.device)
    with rows_subset(rows):  # the LoRA adapters of these rows only (fv_core.adapters)
        return hidden.index_copy(0, rows, block(index, hidden.index_select(0, rows), rows))
