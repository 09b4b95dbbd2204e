"""Unmerged LoRA per row: one call carries requests with different adapters, or none.

Each plan on a model with an adapter plane carries its rows' adapters as an id per row (the runner
adds it, ``with_adapter_rows``); the batcher concatenates those ids with the other inputs, and the
plan's body (``RowsBody``) sets them around the call. A forward hook on every targeted linear
then adds, for each adapter in the call, ``scale * ((x @ A.T) @ B.T)`` to that adapter's rows only:
rows without adapters pay nothing, and no weights are ever merged, so switching adapters costs nothing.

A module called on a tensor whose first dim is not the call's rows (e.g. a timestep embedding over
``[rows, tokens]`` flattened) sees each row's adapters repeated over its share of that dim, in order.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F

from fv_core.errors import ConfigError
from fv_core.loop.pins import ADAPTER_USES


@dataclass(frozen=True, slots=True)
class AdapterUse:
    """One adapter a request runs: its name, the version of its weights, the request's scale."""

    name: str
    version: str
    scale: float
    components: tuple[str, ...]  # the components its file targets (cache keys of what they make)

    @property
    def key(self) -> str:
        return f"{self.name}@{self.version}"


RowAdapters = tuple[AdapterUse, ...]  # one row's adapters, in the order the request named them
_ROWS: ContextVar[tuple[RowAdapters, ...] | None] = ContextVar("fv_adapter_rows", default=None)
ROWS_INPUT = "fv_adapter_rows"  # the plan input naming each row's adapters (an id per row)
_IDS: dict[RowAdapters, int] = {(): 0}  # each adapter combination a request ran -> its row id
_BY_ID: list[RowAdapters] = [()]
_IDS_LOCK = threading.Lock()


def row_id(uses: RowAdapters) -> int:
    """A small integer naming ``uses`` in this process (0: no adapters)."""
    with _IDS_LOCK:
        if uses not in _IDS:
            _IDS[uses] = len(_BY_ID)
            _BY_ID.append(uses)
        return _IDS[uses]


class RowsBody:
    """A plan's body that applies each row's adapters: the rows' ids travel as one more tensor input,
    concatenated with the other plans' by the batcher like any input, and are read back here."""

    def __init__(self, body: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        self.body = body

    def __call__(self, inputs: dict[str, Any]) -> dict[str, Any]:
        inputs = dict(inputs)
        rows = tuple(_BY_ID[i] for i in inputs.pop(ROWS_INPUT).tolist())
        with adapter_rows(rows if any(rows) else None):
            return self.body(inputs)


def with_adapter_rows(instance: Any, uses: RowAdapters, plan: Any) -> Any:
    """``plan`` carrying its rows' adapters, on an instance with an adapter plane (every plan there does,
    with or without adapters, so any two may share a call); other plans unchanged."""
    if getattr(instance, "adapters", None) is None or ROWS_INPUT in plan.inputs:
        return plan
    plan.inputs = {**plan.inputs, ROWS_INPUT: torch.full((plan.batch_size,), row_id(uses), dtype=torch.int64)}
    plan.body = RowsBody(plan.body)
    return plan


def release_adapters(instance: Any, request_id: str) -> None:
    """A request's loop ended: its adapters may be evicted again (a program's next stage holds them anew)."""
    plane = getattr(instance, "adapters", None)
    if plane is not None:
        plane.release(request_id)


def uses_of(values: dict[str, Any]) -> RowAdapters:
    """The adapters a LoopState's values name (``pins.ADAPTER_USES``)."""
    return tuple(AdapterUse(n, v, s, tuple(c)) for n, v, s, c in values.get(ADAPTER_USES, ()))


@contextlib.contextmanager
def adapter_rows(rows: tuple[RowAdapters, ...] | None) -> Iterator[None]:
    """Run the body of a call with ``rows``' adapters applied by the hooked linears."""
    token = _ROWS.set(rows)
    try:
        yield
    finally:
        _ROWS.reset(token)


@contextlib.contextmanager
def rows_subset(index: torch.Tensor) -> Iterator[None]:
    """Inside a call, a sub-call on its rows ``index`` (a block interceptor running some rows' blocks):
    the adapters of those rows only."""
    rows = _ROWS.get()
    with adapter_rows(None if rows is None else tuple(rows[i] for i in index.tolist())):
        yield


def lora_hook(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
    """Forward hook of a targeted linear: its output plus each adapter's delta on that adapter's rows."""
    rows = _ROWS.get()
    if rows is None:
        return None
    table = cast("dict[str, Any]", module.fv_adapters)  # adapter key -> LowRank, set by the plane
    x = args[0]
    groups: dict[AdapterUse, list[int]] = {}
    for i, row in enumerate(rows):
        for use in row:
            if use.key in table:
                groups.setdefault(use, []).append(i)
    if not groups:
        return None
    repeat = _repeat(x.shape[0], len(rows), module)
    # in place where autograd allows it (serving): no copy of the output per adapter; a copy where a
    # gradient flows through the output or into a pair (training, fv_core.adapters.TrainableLora)
    trains = any(table[u.key].down.requires_grad or table[u.key].up.requires_grad for u in groups)
    out = output.clone() if torch.is_grad_enabled() and (output.requires_grad or trains) else output
    if all(len(members) == len(rows) for members in groups.values()):
        # every row runs the same adapters (a request alone): exactly PEFT's order, scale then add
        for use in groups:
            out += _delta(x, table[use.key]) * (table[use.key].scale * use.scale)
        return out
    for use, members in groups.items():
        pair = table[use.key]
        scale = pair.scale * use.scale
        first, last = members[0], members[-1] + 1
        if last - first == len(members) and out.is_contiguous():  # a plan's rows are contiguous: views
            part = slice(first * repeat, last * repeat)
            hidden = F.linear(x[part].to(pair.down.dtype), pair.down)
            # the up projection, its scale and the sum in one GEMM (C += s A B) on the rows' own output
            out[part].view(-1, out.shape[-1]).addmm_(
                hidden.view(-1, hidden.shape[-1]).to(out.dtype), pair.up.t().to(out.dtype), alpha=scale
            )
            continue
        index = torch.tensor(members, device=x.device)
        if repeat > 1:
            index = (index[:, None] * repeat + torch.arange(repeat, device=x.device)).flatten()
        out.index_add_(0, index, _delta(x.index_select(0, index), pair) * scale)
    return out


def _delta(x: torch.Tensor, pair) -> torch.Tensor:
    down, up = pair.down, pair.up
    return F.linear(F.linear(x.to(down.dtype), down), up).to(x.dtype)


def _repeat(leading: int, rows: int, module: torch.nn.Module) -> int:
    if leading % rows:
        raise ConfigError(
            f"a LoRA-targeted module ({getattr(module, 'fv_path', type(module).__name__)}) was called on "
            f"{leading} leading rows in a call of {rows} requests' rows; per-row adapters need the batch first. "
            "Fix: run requests with different adapters apart (determinism: bitwise), or report the model code."
        )
    return leading // rows
