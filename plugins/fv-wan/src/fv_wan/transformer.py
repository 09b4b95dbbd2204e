"""WanTransformer3DModel driven at block granularity.

The same math as the module's own ``forward``, split into stages so interceptors,
kernels and sequence parallelism can reach each block. The text side of every
block's cross-attention (text projection, then each block's key and value) does
not depend on the timestep, so it is computed once per prompt by :func:`text_kv`
and reused by every denoise step; so is the image side of Wan2.1 I2V's
cross-attention (:func:`image_kv`). A timestep is one per sample ``[B]`` or, for
Wan2.2 TI2V, one per latent token ``[B, tokens]``.

Text keys/values may come folded (``kv_rows``): padded prompts end in a run of
bit-identical positions, so ``kv`` holds each row's first ``kv_rows[b]``
positions (the last one the repeated one; zeros may pad the rest in a batch):
a request holds its prompt's keys/values, not 512 padded ones. A call of one
row unfolds its block's full ``kv_length`` positions while that block runs, so
a request alone stays bit for bit diffusers'. A call of several rows (a batch,
or batched CFG) attends to the folds themselves, the repeated position counted
as often as it repeats (its multiplicity as a logit bias, in float32): the same
attention to within float rounding (the batched tolerance), at the cost of the
prompt's length instead of 512.

The batch-invariant path (``invariant=True``: ``denoise_body``'s ``invariant_body`` under
``determinism: bitwise``) gives every row of a call the bits it gets alone: the patch embedding and
the timestep embedding (one-row GEMMs) run per row, and folded keys/values are unfolded per row to
the full length, as a lone row unfolds them; the per-token linears and attention batch as they are
(row-invariant where ``WanLoop`` declares it: measured by ``fv_core.loop.gemm_rows_invariant`` and
``attention_rows_invariant``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from fv_core.cache import RepeatedTail, tail_start
from fv_core.extend import BlockHook, BlockHooks, drive_blocks
from fv_core.loop import per_row
from fv_core.parallel import gather, shard
from fv_wan.attention import token_grid

# around_block(index, hidden, run) -> hidden; ``run(hidden)`` computes block ``index`` for real.
AroundBlock = Callable[[int, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]], torch.Tensor]


def text_kv(model, text: torch.Tensor) -> torch.Tensor:
    """Cross-attention keys and values of every block for text embeddings [B, L, text_dim].

    Returns [B, blocks, 2, L, dim]: per block the normalised key and the value.
    """
    return torch.stack(list(_block_kv(model, text)), 1)


def folded_text_kv(model, text: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`text_kv` folded, one block at a time (the full keys/values never exist at once): returns
    ``kv`` [B, blocks, 2, H, dim] and ``kv_rows`` [B], the positions each row holds; a row's later
    positions, up to H and on to L, repeat its last held one (see :func:`prepare`)."""
    heads, rows = [], torch.zeros(text.shape[0], dtype=torch.int64)
    for kv in _block_kv(model, text):
        ends = torch.tensor([tail_start(row, 1) + 1 for row in kv])
        rows = rows.maximum(ends)
        heads.append(kv[:, :, : int(ends.max())].clone())
    held = int(rows.max())
    return torch.stack([RepeatedTail(h, held, 2).expand() for h in heads], 1), rows


def _block_kv(model, text: torch.Tensor) -> Iterator[torch.Tensor]:
    """Each block's normalised cross-attention key and value [B, 2, L, dim] for text embeddings."""
    context = model.condition_embedder.text_embedder(text)
    for b in model.blocks:
        yield torch.stack([b.attn2.norm_k(b.attn2.to_k(context)), b.attn2.to_v(context)], 1)


def image_kv(model, image: torch.Tensor) -> torch.Tensor:
    """The image side of every block's cross-attention for CLIP features [B, N, image_dim] (I2V models).

    Returns [B, blocks, 2, N', dim]: per block the normalised added key and the added value.
    """
    context = model.condition_embedder.image_embedder(image)
    per_block = [
        torch.stack([b.attn2.norm_added_k(b.attn2.add_k_proj(context)), b.attn2.add_v_proj(context)], 1)
        for b in model.blocks
    ]
    return torch.stack(per_block, 1)


@dataclass(slots=True)
class Prepared:
    """Everything the blocks need, computed once per call."""

    hidden: torch.Tensor  # [B, tokens, dim] patch embeddings
    kv: torch.Tensor  # [B, blocks, 2, L, dim] cross-attention keys/values (text_kv)
    modulation: torch.Tensor  # [B, 6, dim] per-block timestep modulation ([B, tokens, 6, dim] per token)
    temb: torch.Tensor  # [B, dim] timestep embedding for the output norm ([B, tokens, dim] per token)
    rotary: tuple[torch.Tensor, torch.Tensor]  # rope (cos, sin)
    grid: tuple[int, int, int]  # latent grid after patching (frames, height, width)
    image_kv: torch.Tensor | None = None  # [B, blocks, 2, N, dim] image cross-attention (image_kv), I2V
    kv_length: int = 0  # folded ``kv``: the full text length (0: ``kv`` is full)
    kv_rows: torch.Tensor | None = None  # folded ``kv``: the positions each row holds
    # folded ``kv`` of several rows: [B, H] log of how often each held position counts (-inf: padding)
    kv_log_count: torch.Tensor | None = None

    def block_kv(self, index: int) -> torch.Tensor:
        """Block ``index``'s text keys/values [B, 2, L, dim], unfolded when ``kv`` is folded (one row:
        it repeats its last held position up to ``kv_length``)."""
        kv = self.kv[:, index]
        held = kv.shape[2]
        if self.kv_length <= held:
            return kv
        if kv.shape[0] > 1:  # the invariant path: each row unfolded from its own last held position
            assert self.kv_rows is not None, "folded keys/values of several rows come with kv_rows"
            last = (self.kv_rows.to(kv.device) - 1)[:, None]
            pos = torch.arange(self.kv_length, device=kv.device)[None].minimum(last)
            return kv.gather(2, pos[:, None, :, None].expand(-1, 2, -1, kv.shape[-1]))
        return torch.cat([kv, kv[:, :, held - 1 :].expand(-1, -1, self.kv_length - held, -1)], 2)


def fold_log_count(kv_rows: torch.Tensor, held: int, kv_length: int) -> torch.Tensor:
    """[B, held] log multiplicity of each held position of a batch of folds: 0 before a row's repeated
    position, log(kv_length - kv_rows[b] + 1) at it (it stands for the rest of the text), -inf after."""
    last = (kv_rows - 1)[:, None]
    pos = torch.arange(held, device=kv_rows.device)[None]
    repeats = (kv_length - last).to(torch.float32).log().expand(-1, held)
    return torch.where(pos < last, 0.0, torch.where(pos == last, repeats, -torch.inf))


def prepare(
    model,
    latents: torch.Tensor,
    timestep: torch.Tensor,
    kv: torch.Tensor,
    img_kv: torch.Tensor | None = None,
    kv_rows: torch.Tensor | None = None,
    kv_length: int = 0,
    invariant: bool = False,
) -> Prepared:
    """Patch embedding, rope and timestep embedding (``timestep`` [B] or per token [B, tokens]); ``kv``
    folded when ``kv_rows`` (positions each row holds) is given, ``kv_length`` its full length;
    ``invariant``: every row as it is alone (see the module docstring)."""
    p_t, p_h, p_w = model.config.patch_size
    _, _, frames, height, width = latents.shape
    rotary = model.rope(latents)
    if invariant:
        hidden = per_row(lambda x: _patches(model, x), latents)
        temb = per_row(lambda t: _time_embedding(model, t, kv.dtype), timestep)
    else:
        hidden, temb = _patches(model, latents), _time_embedding(model, timestep, kv.dtype)
    modulation = (
        per_row(lambda e: _modulation_of(model, e), temb) if invariant else _modulation_of(model, temb)
    )
    grid = (frames // p_t, height // p_h, width // p_w)
    folded = kv_rows is not None
    log_count = None
    if folded and kv.shape[0] > 1 and not invariant:
        held = int(kv_rows.max())
        # the rows' own positions: padding past the call's longest fold never shows in the bits
        kv = kv[:, :, :, :held].contiguous()
        log_count = fold_log_count(kv_rows.to(kv.device), held, kv_length)
    return Prepared(
        hidden, kv, modulation, temb, rotary, grid, img_kv, kv_length if folded else 0, kv_rows, log_count
    )


def _patches(model, latents: torch.Tensor) -> torch.Tensor:
    """Patch embeddings [B, tokens, dim] of latents [B, C, F, H, W]."""
    return model.patch_embedding(latents).flatten(2).transpose(1, 2).contiguous()


def _time_embedding(model, timestep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Timestep embedding [B, dim] (per token [B, tokens, dim]) of ``timestep`` [B] (or [B, tokens])."""
    emb = model.condition_embedder
    per_token = timestep.shape[1] if timestep.ndim == 2 else None
    t = emb.timesteps_proj(timestep.flatten())
    if per_token is not None:
        t = t.unflatten(0, (-1, per_token))
    t_dtype = next(iter(emb.time_embedder.parameters())).dtype
    return emb.time_embedder(t if t.dtype == t_dtype or t_dtype == torch.int8 else t.to(t_dtype)).to(dtype)


def _modulation_of(model, temb: torch.Tensor) -> torch.Tensor:
    """Every block's timestep modulation [B, 6, dim] (per token [B, tokens, 6, dim])."""
    emb = model.condition_embedder
    return emb.time_proj(emb.act_fn(temb)).unflatten(temb.ndim - 1, (6, -1))


def _modulation(table: torch.Tensor, modulation: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A block's ``scale_shift_table`` [1, 6, dim] plus the timestep modulation [B, 6, dim] (or per token
    [B, tokens, 6, dim]): shift, scale, gate of self-attention and of the feed-forward, each broadcasting
    over [B, tokens, dim]."""
    if modulation.ndim == 4:
        return tuple(c.squeeze(2) for c in (table.unsqueeze(0) + modulation.float()).chunk(6, 2))
    return (table + modulation.float()).chunk(6, 1)


def _attend(query: torch.Tensor, kv: torch.Tensor, heads: int) -> torch.Tensor:
    key, value = (kv[:, i].unflatten(2, (heads, -1)) for i in (0, 1))
    q, k, v = (t.permute(0, 2, 1, 3) for t in (query, key, value))
    out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=False)
    return out.permute(0, 2, 1, 3).flatten(2, 3).type_as(query)


def _attend_folded(
    query: torch.Tensor, kv: torch.Tensor, log_count: torch.Tensor, heads: int
) -> torch.Tensor:
    """Attention over folded keys/values [B, 2, H, dim], position p of row b counting
    ``exp(log_count[b, p])`` times: softmax(q k / sqrt(d) + log_count) v, in float32 (a low-precision
    bias would miscount the padding)."""
    key, value = (kv[:, i].unflatten(2, (heads, -1)) for i in (0, 1))
    q, k, v = (t.permute(0, 2, 1, 3).float() for t in (query, key, value))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=log_count[:, None, None, :])
    return out.permute(0, 2, 1, 3).flatten(2, 3).type_as(query)


def _attend_context(
    query: torch.Tensor, kv: torch.Tensor, img_kv: torch.Tensor | None, heads: int
) -> torch.Tensor:
    """Attention of ``query`` over the text keys/values plus, for I2V, over the image ones (summed)."""
    out = _attend(query, kv, heads)
    return out if img_kv is None else out + _attend(query, img_kv, heads)


def cross_attention(
    attn, x: torch.Tensor, kv: torch.Tensor, img_kv: torch.Tensor | None = None
) -> torch.Tensor:
    """``attn2`` with precomputed text key/value ([B, 2, L, dim]) and, for I2V, image key/value: the two
    attentions are computed separately and summed, as Wan does."""
    query = attn.norm_q(attn.to_q(x)).unflatten(2, (attn.heads, -1))
    return attn.to_out[1](attn.to_out[0](_attend_context(query, kv, img_kv, attn.heads)))


def block_cross_attention(attn, x: torch.Tensor, prep: Prepared, index: int) -> torch.Tensor:
    """:func:`cross_attention` of block ``index`` over ``prep``'s keys/values: over the folds themselves
    when the call has several rows (:func:`_attend_folded`), else unfolded."""
    img_kv = None if prep.image_kv is None else prep.image_kv[:, index]
    if prep.kv_log_count is None:
        return cross_attention(attn, x, prep.block_kv(index), img_kv)
    query = attn.norm_q(attn.to_q(x)).unflatten(2, (attn.heads, -1))
    out = _attend_folded(query, prep.kv[:, index], prep.kv_log_count, attn.heads)
    if img_kv is not None:
        out = out + _attend(query, img_kv, attn.heads)
    return attn.to_out[1](attn.to_out[0](out))


def block_forward(block, hidden: torch.Tensor, prep: Prepared, index: int) -> torch.Tensor:
    """One WanTransformerBlock: modulated self-attention, cross-attention, modulated feed-forward."""
    shift, scale, gate, c_shift, c_scale, c_gate = _modulation(block.scale_shift_table, prep.modulation)
    norm = (block.norm1(hidden.float()) * (1 + scale) + shift).type_as(hidden)
    with token_grid(prep.grid):  # grid kernels (STA) on attn1 read it
        attn = block.attn1(norm, None, None, prep.rotary)
    hidden = (hidden.float() + attn * gate).type_as(hidden)
    norm = block.norm2(hidden.float()).type_as(hidden)
    hidden = hidden + block_cross_attention(block.attn2, norm, prep, index)
    norm = (block.norm3(hidden.float()) * (1 + c_scale) + c_shift).type_as(hidden)
    return (hidden.float() + block.ffn(norm).float() * c_gate).type_as(hidden)


def run_blocks(
    model,
    prep: Prepared,
    around_block: AroundBlock | None = None,
    hook: BlockHook | BlockHooks | None = None,
    branch: str = "main",
) -> torch.Tensor:
    """``for block in blocks``: the seam for block interceptors.

    ``around_block`` wraps each block call; ``hook`` (fv's block seam) lets a
    block interceptor decide which blocks of CFG ``branch`` run at all.
    """

    picked: dict[tuple[int, ...], Prepared] = {}  # per-row inputs of the row subsets a batched hook runs

    def block(index: int, hidden: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        mine = prep if rows is None else picked.setdefault(tuple(rows.tolist()), pick_rows(prep, rows))

        def run(h: torch.Tensor) -> torch.Tensor:
            return block_forward(model.blocks[index], h, mine, index)

        return run(hidden) if around_block is None else around_block(index, hidden, run)

    return drive_blocks(hook, branch, prep.hidden, len(model.blocks), block)


def pick_rows(prep: Prepared, rows: torch.Tensor) -> Prepared:
    """The batch rows ``rows`` of everything per row a block reads (rope is shared by every row)."""

    batch = prep.hidden.shape[0]

    def pick(t: torch.Tensor) -> torch.Tensor:
        return t.index_select(0, rows.to(t.device)) if t.shape[0] == batch else t

    img_kv = None if prep.image_kv is None else pick(prep.image_kv)
    kv_rows = None if prep.kv_rows is None else prep.kv_rows.index_select(0, rows.to(prep.kv_rows.device))
    log_count = None if prep.kv_log_count is None else pick(prep.kv_log_count)
    return replace(
        prep,
        kv=pick(prep.kv),
        modulation=pick(prep.modulation),
        image_kv=img_kv,
        kv_rows=kv_rows,
        kv_log_count=log_count,
    )


def shard_tokens(prep: Prepared) -> Prepared:
    """This rank's tokens of everything per token (patches, rope on their global positions, per-token
    timestep modulation) under sequence parallelism; ``prep`` itself otherwise."""
    per_token = prep.modulation.ndim == 4
    return replace(
        prep,
        hidden=shard(prep.hidden, 1),
        modulation=shard(prep.modulation, 1) if per_token else prep.modulation,
        temb=shard(prep.temb, 1) if per_token else prep.temb,
        rotary=(shard(prep.rotary[0], 1), shard(prep.rotary[1], 1)),
    )


def finish(model, prep: Prepared, hidden: torch.Tensor) -> torch.Tensor:
    """Output norm with timestep shift/scale and projection (on this rank's tokens), then the whole
    sequence and unpatchify."""
    table, temb = model.scale_shift_table, prep.temb.unsqueeze(-2)  # [1, 2, dim]; [B(, tokens), 1, dim]
    if temb.ndim == 4:  # per token
        shift, scale = (c.squeeze(2) for c in (table.unsqueeze(0) + temb).chunk(2, dim=2))
    else:
        shift, scale = (table + temb).chunk(2, dim=1)
    hidden = (model.norm_out(hidden.float()) * (1 + scale) + shift).type_as(hidden)
    frames, height, width = prep.grid
    hidden = gather(model.proj_out(hidden), 1, frames * height * width)
    p_t, p_h, p_w = model.config.patch_size
    hidden = hidden.reshape(hidden.shape[0], frames, height, width, p_t, p_h, p_w, -1)
    return hidden.permute(0, 7, 1, 4, 2, 5, 3, 6).flatten(6, 7).flatten(4, 5).flatten(2, 3)


def wan_forward_kv(
    model,
    latents: torch.Tensor,
    timestep: torch.Tensor,
    kv: torch.Tensor,
    around_block: AroundBlock | None = None,
    hook: BlockHook | BlockHooks | None = None,
    branch: str = "main",
    img_kv: torch.Tensor | None = None,
    kv_rows: torch.Tensor | None = None,
    kv_length: int = 0,
    invariant: bool = False,
) -> torch.Tensor:
    """Flow velocity for ``latents`` [B, C, F, H, W] at ``timestep`` [B] (or [B, tokens]) given ``text_kv``
    output, full or folded (``kv_rows``, ``kv_length``: see :func:`prepare`), and ``image_kv`` output
    for I2V models; ``invariant``: each row's bits as alone (see the module docstring)."""
    prep = shard_tokens(prepare(model, latents, timestep, kv, img_kv, kv_rows, kv_length, invariant))
    return finish(model, prep, run_blocks(model, prep, around_block, hook, branch))


def wan_forward(
    model,
    latents: torch.Tensor,
    timestep: torch.Tensor,
    text: torch.Tensor,
    around_block: AroundBlock | None = None,
) -> torch.Tensor:
    """Flow velocity given text embeddings [B, L, text_dim] (what ``model(...)`` computes)."""
    return wan_forward_kv(model, latents, timestep, text_kv(model, text), around_block)
