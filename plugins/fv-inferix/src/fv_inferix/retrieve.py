"""Per-layer retrieval of cached blocks: what one pass of a chunk attends to.

Each cached block is summarised, per layer and head, by the mean of its keys. A new block's relevance
to it is the mean attention logit between the new block's queries and that block's keys, which for
means is exactly ``mean(q) . mean(k) / sqrt(d)`` (averaged over heads). Every layer keeps the blocks
its policy always keeps (sinks and the most recent ``local_blocks``) plus its ``global_blocks`` most
relevant other blocks, and attends to their tokens only, gathered in cache order: the attention's
cost follows the kept blocks, not the whole cache.
"""

from __future__ import annotations

import math

import torch


class Selector:
    """One pass's retrieval over a batch of rows (requests); ``outputs()`` reports what it kept."""

    def __init__(self, inputs: dict[str, torch.Tensor]) -> None:
        self.slots = inputs["kv_slots"]  # [B, S] block slot of each context token, -1 on padding
        self.keep = inputs["kv_keep"]  # [B, NS] slots always attended
        self.top = inputs["kv_top"]  # [B] blocks each layer retrieves (-1: every one)
        rows, slots = self.keep.shape
        device = self.keep.device  # statistics stay there until the pass ends (no sync per layer)
        self.relevance = torch.zeros(rows, slots, device=device)  # summed over layers: each slot's share
        self.picked = torch.zeros(rows, slots, dtype=torch.long, device=device)  # layers that retrieved it
        self.attended = torch.zeros(rows, device=device)  # context tokens attended, summed over layers
        self.layers = 0

    def __call__(
        self, layer: int, q: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor, valid: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The context ``ctx_k``/``ctx_v`` [B, H, S, D] (real where ``valid`` [B, S]) that queries ``q``
        [B, H, T, D] of one layer attend to: the kept and retrieved blocks' tokens, and their mask."""
        self.layers += 1
        if ctx_k.shape[2] == 0:
            return ctx_k, ctx_v, valid
        score, present = block_scores(q, ctx_k, self.slots, self.keep.shape[1])
        picked = retrieve(score, present & ~self.keep, self.top)
        attend = present & (self.keep | picked)
        share = torch.softmax(score.masked_fill(~present, -math.inf), dim=1).nan_to_num(0.0)
        self.relevance += share
        self.picked += picked.long()
        tokens = attend.gather(1, self.slots.clamp(min=0)) & (self.slots >= 0) & valid
        self.attended += tokens.sum(1).float()
        if torch.equal(tokens, valid):  # every cached token stays: the context as it is
            return ctx_k, ctx_v, valid
        return compact(ctx_k, ctx_v, tokens)

    def outputs(self) -> dict[str, torch.Tensor]:
        layers = max(self.layers, 1)
        return {
            "kv_relevance": self.relevance / layers,  # [B, NS] mean over layers of each slot's share
            "kv_picked": self.picked,  # [B, NS] layers that retrieved the slot (beyond the kept ones)
            "kv_attended": self.attended / layers,  # [B] context tokens a layer attended, on average
        }


def block_scores(
    q: torch.Tensor, ctx_k: torch.Tensor, slots: torch.Tensor, num_slots: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each slot's relevance [B, NS] (mean over heads of mean(q) . mean(k) / sqrt(d)) and which slots
    hold tokens [B, NS]."""
    rows, heads, _, dim = ctx_k.shape
    index = (slots + 1).clamp(min=0)  # slot 0 collects the padding
    sums = ctx_k.new_zeros(rows, heads, num_slots + 1, dim, dtype=torch.float32)
    sums.scatter_add_(2, index[:, None, :, None].expand(rows, heads, -1, dim), ctx_k.float())
    counts = torch.zeros(rows, num_slots + 1, device=ctx_k.device).scatter_add_(
        1, index, torch.ones_like(index, dtype=torch.float32)
    )
    means = sums[:, :, 1:] / counts[:, None, 1:, None].clamp(min=1)
    score = torch.einsum("bhd,bhnd->bn", q.float().mean(2), means) / (heads * math.sqrt(dim))
    return score, counts[:, 1:] > 0


def retrieve(score: torch.Tensor, candidates: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """The ``top[row]`` highest-scoring ``candidates`` of each row (all of them where ``top`` < 0);
    ties go to the earlier slot."""
    ranked = score.masked_fill(~candidates, -math.inf)
    order = torch.argsort(ranked, dim=1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(
        1, order, torch.arange(order.shape[1], device=order.device).expand_as(order)
    )
    limit = torch.where(top < 0, torch.full_like(top, order.shape[1]), top).to(score.device)
    return candidates & (rank < limit[:, None])


def compact(
    ctx_k: torch.Tensor, ctx_v: torch.Tensor, tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``tokens`` [B, S] of the context, in order, moved to the front and cut to the longest row."""
    count = tokens.sum(1)
    width = int(count.max())
    order = torch.argsort((~tokens).to(torch.int8), dim=1, stable=True)[:, :width]
    rows, heads, _, dim = ctx_k.shape
    index = order[:, None, :, None].expand(rows, heads, width, dim)
    kept = torch.arange(width, device=tokens.device)[None] < count[:, None]
    return ctx_k.gather(2, index), ctx_v.gather(2, index), kept
