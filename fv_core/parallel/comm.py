"""What a step body uses inside a parallel group: its rank's place, shard / gather, Ulysses all-to-all.

A family's parallel step runs on every rank of the group at once (SPMD). It reads ``Rank`` for its
coordinates, shards tokens with :func:`shard` (uneven shards allowed: ``torch.tensor_split``), wraps
self-attention in :func:`seq_to_heads` / :func:`heads_to_seq`, and reduces any statistic that decides
control flow with :func:`global_mean` so every rank of a Ulysses group takes the same branch. Every
collective adds its bytes to ``Traffic`` so benches can report communication volume.

Outside a group (``current() is None``) the helpers are the single-process identities.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from fv_core.parallel.plan import ParallelPlan


@dataclass(slots=True)
class Traffic:
    """Bytes this process sent through collectives, by kind."""

    bytes: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, n: int) -> None:
        self.bytes[kind] = self.bytes.get(kind, 0) + n

    def total(self) -> int:
        return sum(self.bytes.values())


TRAFFIC = Traffic()  # this process's counters (rank 0 reads its own; workers report theirs per step)


@dataclass(frozen=True, slots=True)
class Rank:
    """One rank's place in its group."""

    rank: int  # global rank (0 drives)
    plan: ParallelPlan
    sp_index: int  # index within its Ulysses group
    cfg_index: int  # which guidance branch(es) it runs
    sp_group: Any  # torch.distributed group of the ranks sharing its cfg (and data) index; None when sp=1
    cfg_sp_group: Any  # the group of the ranks sharing its data index (every cfg and sp index)
    reduce_group: Any = None  # ranks whose pieces make one forward: global_mean reduces over them
    reduce_size: int = 1  # how many ranks reduce_group holds

    @property
    def sp(self) -> int:
        return self.plan.sequence

    def branch(self, name: str, rows_split: bool = False) -> str:
        """The block-cache branch of this rank's piece of ``name``: each sequence shard (and, when one
        forward's rows are split over cfg ranks, each row share) keeps its own cached residuals."""
        suffix = f"#cfg{self.cfg_index}" if rows_split and self.cfg_index else ""
        return name + suffix + (f"#sp{self.sp_index}" if self.sp_index else "")

    def forward(self, rows_split: bool) -> Rank:
        """This rank computing one forward whose tokens are split over its Ulysses group and, with
        ``rows_split``, whose rows are split over the cfg ranks too (statistics reduce over both)."""
        if rows_split and self.plan.cfg > 1:
            return replace(self, reduce_group=self.cfg_sp_group, reduce_size=self.plan.cfg * self.sp)
        return replace(self, reduce_group=self.sp_group, reduce_size=self.sp)


_CURRENT: ContextVar[Rank | None] = ContextVar("fv_parallel_rank", default=None)


def current() -> Rank | None:
    """The rank of the parallel step running in this context (None outside one)."""
    return _CURRENT.get()


@contextmanager
def running_as(rank: Rank) -> Iterator[None]:
    reset = _CURRENT.set(rank)
    try:
        yield
    finally:
        _CURRENT.reset(reset)


def sequence_parallel() -> Rank | None:
    """The current rank when its step shards the sequence (sp > 1), else None."""
    rank = current()
    return rank if rank is not None and rank.sp > 1 else None


def split_sizes(n: int, parts: int) -> list[int]:
    """Rows of each of ``parts`` shards of ``n`` (``torch.tensor_split``'s: the first ``n % parts`` get one more)."""
    return [n // parts + (i < n % parts) for i in range(parts)]


def shard(x: torch.Tensor, dim: int) -> torch.Tensor:
    """This rank's Ulysses shard of ``x`` along ``dim`` (all of it outside sequence parallelism)."""
    rank = sequence_parallel()
    if rank is None:
        return x
    return x.tensor_split(rank.sp, dim=dim)[rank.sp_index].contiguous()


def gather(x: torch.Tensor, dim: int, full: int) -> torch.Tensor:
    """The whole of ``x`` along ``dim`` (``full`` long) from every rank's shard, on every rank."""
    rank = sequence_parallel()
    if rank is None:
        return x
    sizes = split_sizes(full, rank.sp)
    moved = x.movedim(dim, 0).contiguous()
    pieces = [moved.new_empty((n, *moved.shape[1:])) for n in sizes]
    most = max(sizes)
    padded = torch.cat([moved, moved.new_zeros((most - moved.shape[0], *moved.shape[1:]))])
    slots = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(slots, padded, group=rank.sp_group)
    TRAFFIC.add("all_gather", padded.numel() * padded.element_size() * (rank.sp - 1))
    for i, n in enumerate(sizes):
        pieces[i] = slots[i][:n]
    return torch.cat(pieces).movedim(0, dim)


def seq_to_heads(x: torch.Tensor, tokens: int) -> torch.Tensor:
    """``[B, tokens/sp, H, D]`` (this rank's tokens, all heads) -> ``[B, tokens, H/sp, D]`` (all tokens,
    this rank's heads). ``tokens``: the full sequence length."""
    rank = sequence_parallel()
    if rank is None:
        return x
    heads = x.shape[2] // rank.sp
    # rows sent to rank j: its head slice of my tokens
    send = x.unflatten(2, (rank.sp, heads)).movedim(2, 0).contiguous()  # [sp, B, s, h, D]
    sizes = split_sizes(tokens, rank.sp)
    recv = x.new_empty((tokens, x.shape[0], heads, x.shape[3]))
    flat = send.permute(0, 2, 1, 3, 4).reshape(-1, x.shape[0], heads, x.shape[3])  # [sp*s, B, h, D]
    mine = x.shape[1]
    dist.all_to_all_single(recv, flat, sizes, [mine] * rank.sp, group=rank.sp_group)
    TRAFFIC.add("all_to_all", flat.numel() * flat.element_size() * (rank.sp - 1) // rank.sp)
    return recv.permute(1, 0, 2, 3).contiguous()  # [B, tokens, h, D]


def heads_to_seq(x: torch.Tensor, tokens: int) -> torch.Tensor:
    """The inverse of :func:`seq_to_heads`: ``[B, tokens, H/sp, D]`` -> ``[B, tokens/sp, H, D]``."""
    rank = sequence_parallel()
    if rank is None:
        return x
    sizes = split_sizes(tokens, rank.sp)
    mine = sizes[rank.sp_index]
    send = x.permute(1, 0, 2, 3).contiguous()  # [tokens, B, h, D], in rank order of the token shards
    recv = x.new_empty((rank.sp * mine, x.shape[0], x.shape[2], x.shape[3]))
    dist.all_to_all_single(recv, send, [mine] * rank.sp, sizes, group=rank.sp_group)
    TRAFFIC.add("all_to_all", (tokens - mine) * send[0].numel() * send.element_size())
    # [sp, mine, B, h, D] -> [B, mine, sp*h, D]: rank j's heads come j-th
    return recv.unflatten(0, (rank.sp, mine)).permute(2, 1, 0, 3, 4).flatten(2, 3).contiguous()


def global_mean(x: torch.Tensor) -> torch.Tensor:
    """The mean of ``x`` over the whole forward (every rank's piece of it) as a 0-d tensor; use it for
    any statistic that decides control flow, so every rank takes the same branch."""
    rank = current()
    if rank is None or rank.reduce_size == 1:
        return x.mean()
    totals = torch.stack([x.sum(dtype=torch.float64), torch.tensor(float(x.numel()), dtype=torch.float64)])
    dist.all_reduce(totals, group=rank.reduce_group)
    TRAFFIC.add("all_reduce", totals.numel() * totals.element_size())
    return (totals[0] / totals[1]).to(x.dtype)
