"""A request's context: segments appended in order to its keys/values in the instance's paged KV pool.

A text segment is ``<|im_start|> text <|im_end|>`` (causal, one RoPE position per token), an
understanding image ``<|vision_start|> ViT tokens <|vision_end|>`` and an edited image
``<|vision_start|> clean latent tokens <|vision_end|>`` (bidirectional inside, every token at one RoPE
position, which then advances by one). Each segment is one prefill WorkUnit. The keys/values live in
the instance's paged KV pool (:mod:`fv_core.kv`): the request's LoopState holds its page lists, a step's
inputs are its rows' page tables and real-token masks (the body reads the pool's pages through them one
layer at a time: no padded copy of the whole context per step), ``advance`` writes the request's own
pages, and ``finalize`` / ``release`` (cancel, failure) give them back. Pages a step reads are never
written while it may run: a request writes only its own pages (a shared one is copied first).

Rows of one step may have contexts of different lengths: each table covers a power-of-two bucket of
tokens (``BUCKET``) with its real tokens marked, and the rows of one call the longest
(``WorkPlan.ragged``). Contexts held as tensors (tests) are padded copies.
"""

from __future__ import annotations

from typing import Any

import torch

from fv_core import ConfigError
from fv_core.kv import KVSeq

# context inputs whose rows differ in length: page tables and masks (or padded keys/values)
RAGGED_CONTEXT = {"ctx_pages": 1, "ctx_valid": 1, "ctx_k": 3, "ctx_v": 3}
BUCKET = 16  # smallest padded context length of a step's inputs (then powers of two: ragged rows batch)


def bucket(length: int) -> int:
    """The padded context length of a step: the next power of two from ``BUCKET`` (few distinct shapes)."""
    size = BUCKET
    while size < length:
        size *= 2
    return size


def padded(contexts: list[dict[str, Any]], size: int) -> dict[str, torch.Tensor]:
    """Rows' contexts as step inputs: keys/values ``[R, layers, kvh, size, d]`` and the real-token mask."""
    ks, vs, valid = [], [], []
    for ctx in contexts:
        k, v = ctx["k"], ctx["v"]
        pad = size - k.shape[2]
        ks.append(torch.nn.functional.pad(k, (0, 0, 0, pad)))
        vs.append(torch.nn.functional.pad(v, (0, 0, 0, pad)))
        valid.append(torch.arange(size, device=k.device) < k.shape[2])
    return {"ctx_k": torch.stack(ks), "ctx_v": torch.stack(vs), "ctx_valid": torch.stack(valid)}


def plan_inputs(contexts: list[dict[str, Any]], **tensors: torch.Tensor) -> dict[str, Any]:
    """Step inputs over contexts held as tensors (``k``, ``v``) or as a sequence in a KV pool (``seq``)."""
    if "seq" in contexts[0]:
        pool, seqs = contexts[0]["pool"], [KVSeq(**c["seq"]) for c in contexts]
        pages = pool.pages_for(bucket(max(s.length for s in seqs)))
        return {**tensors, "kv": pool, **pool.table(seqs, pages)}
    size = bucket(max(c["k"].shape[2] for c in contexts))
    return {**tensors, **padded(contexts, size)}


def written(out: dict[str, Any], segment: dict[str, Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys/values a step wrote for its row's own tokens: a text ``segment``'s block, padded in a
    ragged batch, is cut back to its tokens; other blocks are kept whole."""
    k, v = out["k"][0], out["v"][0]
    if segment is None or segment["kind"] != "text":
        return k, v
    n = len(segment["ids"])
    return k[..., :n, :], v[..., :n, :]


def plain(seq: KVSeq) -> dict[str, Any]:
    """A pool sequence as per-request state holds it (plain data)."""
    return {"pages": list(seq.pages), "length": seq.length}


def text_ids(inst: Any, text: str) -> list[int]:
    """A text segment as BAGEL prefills it: ``<|im_start|> tokens <|im_end|>``."""
    sp = inst.special
    return [sp["bos_token_id"], *inst.tokenizer.encode(text), sp["eos_token_id"]]


def check_positions(net: Any, needed: int, what: str) -> None:
    limit = net.language_model.config.max_position_embeddings
    if needed > limit:
        raise ConfigError(
            f"{what} needs {needed} positions; this model has {limit}. Fix: shorten the prompt or lower max_tokens.",
            param="prompt",
        )


def check_written_by(request: Any, net: str | None) -> None:
    """Keys/values handed over by an earlier stage are read only under the ``net`` version that wrote
    them (another version's would condition this stage on activations its weights never made)."""
    for context in request.carry.get("contexts", []):
        if context.get("net") != net:
            raise ConfigError(
                f"request {request.request_id!r} was handed keys/values written by net version "
                f"{context.get('net')!r}, but this stage runs on {net!r}: a stage reads only the keys/values "
                "of the weights it runs on. Fix: pass the earlier stage's weights_versions in the carry "
                "(as fv_bagel.program does), or run the request again."
            )
