"""QwenImageTransformer2DModel driven at block granularity.

The same math as the module's own ``forward`` (no guidance embedding, no edit's zero-cond timestep),
split so interceptors can reach each block: ``prepare`` (image and text input projections, timestep
embedding, rope), the blocks through the core's block seam, ``finish`` (output norm and projection).
Each block is diffusers' own ``QwenImageTransformerBlock`` (double stream: text and image tokens
attend jointly, each stream keeps its own weights). The seam carries one tensor, so the two streams
travel as one sequence ``[text, image]`` that each block splits at the text length and joins again.
Rows whose prompts differ in length batch zero-padded with a text mask (diffusers' own
``encoder_hidden_states_mask``): the image attends to each row's own prompt only.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from fv_core.extend import BlockHook, BlockHooks, drive_blocks


@dataclass(slots=True)
class Prepared:
    """Everything the blocks need, computed once per call."""

    hidden: torch.Tensor  # [B, text + image tokens, dim]: the text stream, then the image stream
    text_len: int  # where the image stream starts
    temb: torch.Tensor  # [B, dim] timestep embedding (block modulation, output norm)
    rotary: tuple[torch.Tensor, torch.Tensor]  # rope (image freqs, text freqs)
    mask: torch.Tensor | None = None  # [B, L] bool, True on each row's own text (None: every position)
    # zero_cond_t (Qwen-Image-Edit-2511): temb is [2B, dim], the rows' timestep then timestep 0, and this
    # [B, image tokens] int picks per image token which (0: the noise's, 1: the input images' at t=0)
    modulate_index: torch.Tensor | None = None


# (frames, rows, columns) of the patched latents; an edit's image stream is several: the noise's, then
# each input image's, laid end to end (rope frame index 0, 1, ...: the model's img_shapes=[[noise, image, ...]])
Grid = tuple[int, int, int] | tuple[tuple[int, int, int], ...]


def grid_list(grid: Grid) -> list:
    """``grid`` as the list of part shapes the model's rope takes for one sample."""
    return list(grid) if isinstance(grid[0], tuple | list) else [grid]


def prepare(
    model,
    latents: torch.Tensor,
    timestep: torch.Tensor,
    text: torch.Tensor,
    grid: Grid,
    mask: torch.Tensor | None = None,
) -> Prepared:
    """``latents`` [B, tokens, C] packed, ``timestep`` [B] in 0..1, ``text`` [B, L, text_dim] (``mask``
    [B, L] bool: the valid positions; None: all), ``grid`` (frames, height, width) of the patched latents
    (or one per part of the image stream: see :data:`Grid`)."""
    image = model.img_in(latents)
    timestep = timestep.to(image.dtype)
    context = model.txt_in(model.txt_norm(text))
    index = None
    if getattr(model, "zero_cond_t", False):  # as the model's forward: the reference tokens at timestep 0
        timestep, noise = torch.cat([timestep, timestep * 0]), math.prod(grid_list(grid)[0])
        index = (
            (torch.arange(latents.shape[1], device=image.device) >= noise).int().expand(latents.shape[0], -1)
        )
    temb = model.time_text_embed(timestep, image)
    rotary = model.pos_embed([grid_list(grid)], max_txt_seq_len=text.shape[1], device=image.device)
    return Prepared(torch.cat([context, image], 1), text.shape[1], temb, rotary, mask, index)


def run_blocks(
    model, prep: Prepared, hook: BlockHook | BlockHooks | None = None, branch: str = "main"
) -> torch.Tensor:
    """``for block in blocks`` through the block seam (``hook``: a block interceptor, per CFG ``branch``)."""
    split = prep.text_len

    def block(index: int, hidden: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        temb, mask, modulate = prep.temb, prep.mask, prep.modulate_index
        if rows is not None:  # a batched block hook runs these rows only
            rows = rows.to(temb.device)
            halves = temb.chunk(2) if modulate is not None else (temb,)  # zero_cond_t: both halves' rows
            temb = torch.cat([h.index_select(0, rows) for h in halves])
            mask = None if mask is None else mask.index_select(0, rows)
            modulate = None if modulate is None else modulate.index_select(0, rows)
        context, image = model.transformer_blocks[index](
            hidden_states=hidden[:, split:],
            encoder_hidden_states=hidden[:, :split],
            encoder_hidden_states_mask=mask,
            temb=temb,
            image_rotary_emb=prep.rotary,
            modulate_index=modulate,
        )
        return torch.cat([context, image], 1)

    return drive_blocks(hook, branch, prep.hidden, len(model.transformer_blocks), block)


def finish(model, prep: Prepared, hidden: torch.Tensor) -> torch.Tensor:
    """Output norm modulated by the timestep, then the projection, on the image stream: [B, tokens, C]."""
    temb = prep.temb if prep.modulate_index is None else prep.temb.chunk(2)[0]
    return model.proj_out(model.norm_out(hidden[:, prep.text_len :], temb))


def qwen_forward(
    model,
    latents: torch.Tensor,
    timestep: torch.Tensor,
    text: torch.Tensor,
    grid: Grid,
    hook: BlockHook | BlockHooks | None = None,
    branch: str = "main",
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Flow velocity [B, tokens, C] (what ``model(hidden_states=latents, timestep=timestep,
    encoder_hidden_states=text, encoder_hidden_states_mask=mask, img_shapes=[[grid]] * B)`` computes)."""
    prep = prepare(model, latents, timestep, text, grid, mask)
    return finish(model, prep, run_blocks(model, prep, hook, branch))


# ---- packed: several requests of different sizes (and prompt lengths) as one sequence ----


@dataclass(slots=True)
class Packed:
    """A packed call: request ``i`` is ``text[i]`` text tokens and ``image[i]`` image tokens; the seam's
    sequence is ``[every request's text; every request's image]``, and in attention each request's
    text and image tokens form one segment attending to itself only (joint attention per request)."""

    hidden: torch.Tensor  # [1, sum text + sum image, dim]
    text: tuple[int, ...]  # text tokens per request
    image: tuple[int, ...]  # image tokens per request
    temb: list[torch.Tensor]  # per request [1, dim] timestep embedding
    rotary: tuple[torch.Tensor, torch.Tensor]  # rope of every image token, of every text token
    order: torch.Tensor  # seam position of each token in segment order (request 0 text, image, 1 ...)
    inverse: torch.Tensor  # the segment-order index of each seam position
    cu_seqlens: torch.Tensor  # segment boundaries [N + 1] in segment order
    kernel: Callable[..., torch.Tensor]  # a packed_attention kernel (fv_core.kernels_packed signature)
    exact: bool = False  # every linear on each request's rows alone (bit for bit alone; see by_request)


def by_request(layer, x: torch.Tensor, lengths: tuple[int, ...], exact: bool) -> torch.Tensor:
    """``layer`` (a linear, or an MLP of linears and elementwise ops) over packed rows ``x`` [1, tokens,
    dim]. A matmul's rows are not invariant to the row count on CPU (BLAS picks another kernel, or splits
    the reduction, for few rows: a prompt's ~10 text tokens differ by ~3e-7 once joined), so ``exact`` runs
    each request's rows alone, as a call of that request alone has them; else one call of all."""
    if not exact or len(lengths) == 1:
        return layer(x)
    return torch.cat([layer(part) for part in x.split(list(lengths), 1)], 1)


def prepare_packed(
    model, latents, timestep, text, grids, image_lens, text_lens, kernel, exact=True
) -> Packed:
    """Each request's input projections, timestep embedding and rope exactly as alone (``latents``
    [1, sum image tokens, C], ``timestep`` [N], ``text`` [1, sum text tokens, text_dim], ``grids`` one per
    request), laid end to end. A kernel that ``pads`` (the ``padded`` variant: padded batching, for
    comparison) gets every request's text and image zero-padded to the longest and a mask of the real
    tokens instead."""
    images, contexts, temb, img_freqs, txt_freqs = [], [], [], [], []
    for i, (lat, txt) in enumerate(zip(latents.split(image_lens, 1), text.split(text_lens, 1), strict=True)):
        image = model.img_in(lat)
        images.append(image)
        contexts.append(model.txt_in(model.txt_norm(txt)))
        temb.append(model.time_text_embed(timestep[i : i + 1].to(image.dtype), image))
        img_f, txt_f = model.pos_embed(
            [grid_list(grids[i])], max_txt_seq_len=txt.shape[1], device=image.device
        )
        img_freqs.append(img_f)
        txt_freqs.append(txt_f)
    if getattr(kernel, "pads", False):
        longest_text, longest_image = max(text_lens), max(image_lens)
        pairs = zip(text_lens, image_lens, strict=True)
        valid = torch.cat([m for t, n in pairs for m in _valid(t, longest_text) + _valid(n, longest_image)])
        kernel = partial(kernel, valid=valid.to(latents.device))
        images, img_freqs = _pad(images, 1, longest_image), _pad(img_freqs, 0, longest_image)
        contexts, txt_freqs = _pad(contexts, 1, longest_text), _pad(txt_freqs, 0, longest_text)
        text_lens, image_lens = [longest_text] * len(text_lens), [longest_image] * len(image_lens)
    hidden = torch.cat(contexts + images, 1)
    order = _segment_order(text_lens, image_lens).to(hidden.device)
    lengths = torch.tensor([t + n for t, n in zip(text_lens, image_lens, strict=True)], dtype=torch.int32)
    cu = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    return Packed(
        hidden,
        tuple(text_lens),
        tuple(image_lens),
        temb,
        (torch.cat(img_freqs), torch.cat(txt_freqs)),
        order,
        torch.argsort(order),
        cu,
        kernel,
        exact,
    )


def _valid(n: int, longest: int) -> list[torch.Tensor]:
    return [torch.ones(n, dtype=torch.bool), torch.zeros(longest - n, dtype=torch.bool)]


def _pad(parts: list[torch.Tensor], dim: int, longest: int) -> list[torch.Tensor]:
    """Each zero-padded at the end of ``dim`` to ``longest``."""
    return [
        torch.cat([p, p.new_zeros(*p.shape[:dim], longest - p.shape[dim], *p.shape[dim + 1 :])], dim)
        for p in parts
    ]


def _segment_order(text_lens, image_lens) -> torch.Tensor:
    total_text, text_at, image_at, parts = sum(text_lens), 0, 0, []
    for t, n in zip(text_lens, image_lens, strict=True):
        parts += [
            torch.arange(text_at, text_at + t),
            torch.arange(total_text + image_at, total_text + image_at + n),
        ]
        text_at, image_at = text_at + t, image_at + n
    return torch.cat(parts)


def _per_token(mods: list[torch.Tensor], lengths: tuple[int, ...]) -> list[torch.Tensor]:
    """Per request modulation [1, 6 dim] to per token shift, scale, gate of norm1 and norm2, [1, tokens,
    dim] each (every request's own values on its tokens)."""
    rows = torch.cat([m[:, None].expand(-1, n, -1) for m, n in zip(mods, lengths, strict=True)], 1)
    return list(rows.chunk(6, -1))


def packed_attention(attn, image: torch.Tensor, context: torch.Tensor, pack: Packed) -> tuple:
    """diffusers' QwenDoubleStreamAttnProcessor2_0 math on a packed call: each request's text and image
    tokens attend jointly, to their own request only (``pack.kernel`` over its segments)."""
    from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen

    head_dim = attn.inner_dim // attn.heads
    images, texts, exact = pack.image, pack.text, pack.exact
    iq, ik, iv = (
        by_request(f, image, images, exact).unflatten(-1, (-1, head_dim))
        for f in (attn.to_q, attn.to_k, attn.to_v)
    )
    tq, tk, tv = (
        by_request(f, context, texts, exact).unflatten(-1, (-1, head_dim))
        for f in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)
    )
    iq, ik = attn.norm_q(iq), attn.norm_k(ik)
    tq, tk = attn.norm_added_q(tq), attn.norm_added_k(tk)
    img_f, txt_f = pack.rotary
    iq, ik = (apply_rotary_emb_qwen(x, img_f, use_real=False) for x in (iq, ik))
    tq, tk = (apply_rotary_emb_qwen(x, txt_f, use_real=False) for x in (tq, tk))
    joint = [
        torch.cat([t, i], 1).index_select(1, pack.order).transpose(1, 2)
        for t, i in ((tq, iq), (tk, ik), (tv, iv))
    ]
    out = pack.kernel(*joint, pack.cu_seqlens).transpose(1, 2).index_select(1, pack.inverse)
    out = out.flatten(2, 3).to(joint[0].dtype)
    split = context.shape[1]
    image_out = by_request(attn.to_out[0], out[:, split:].contiguous(), images, exact)
    if len(attn.to_out) > 1:
        image_out = attn.to_out[1](image_out)
    return image_out, by_request(attn.to_add_out, out[:, :split].contiguous(), texts, exact)


def packed_block(block, hidden: torch.Tensor, pack: Packed) -> torch.Tensor:
    """One QwenImageTransformerBlock (diffusers' math) on a packed call, each token modulated by its own
    request's timestep."""
    split = sum(pack.text)
    context, image = hidden[:, :split], hidden[:, split:]
    i_shift, i_scale, i_gate, i_shift2, i_scale2, i_gate2 = _per_token(
        [block.img_mod(t) for t in pack.temb], pack.image
    )
    t_shift, t_scale, t_gate, t_shift2, t_scale2, t_gate2 = _per_token(
        [block.txt_mod(t) for t in pack.temb], pack.text
    )
    img_in = block.img_norm1(image) * (1 + i_scale) + i_shift
    txt_in = block.txt_norm1(context) * (1 + t_scale) + t_shift
    img_attn, txt_attn = packed_attention(block.attn, img_in, txt_in, pack)
    image = image + i_gate * img_attn
    context = context + t_gate * txt_attn
    img_mlp = by_request(
        block.img_mlp, block.img_norm2(image) * (1 + i_scale2) + i_shift2, pack.image, pack.exact
    )
    txt_mlp = by_request(
        block.txt_mlp, block.txt_norm2(context) * (1 + t_scale2) + t_shift2, pack.text, pack.exact
    )
    image = image + i_gate2 * img_mlp
    context = context + t_gate2 * txt_mlp
    if image.dtype == torch.float16:
        context, image = context.clip(-65504, 65504), image.clip(-65504, 65504)
    return torch.cat([context, image], 1)


def qwen_forward_packed(
    model, latents, timestep, text, grids, image_lens, text_lens, kernel, exact=False
) -> torch.Tensor:
    """Flow velocity [1, sum image tokens, C] of requests packed as one sequence: each request's part
    equals :func:`qwen_forward` of it alone to float rounding; bit for bit with ``exact`` and a kernel
    whose segments are each exactly the request alone (``segments``): the linears then run per request
    (:func:`by_request`), everything else (norms, modulation, rope, residuals) is row by row already. A
    kernel that pads: the same by padded batching (see :func:`prepare_packed`)."""
    pack = prepare_packed(model, latents, timestep, text, grids, image_lens, text_lens, kernel, exact)
    hidden = pack.hidden
    for block in model.transformer_blocks:
        hidden = packed_block(block, hidden, pack)
    images = hidden[:, sum(pack.text) :].split(list(pack.image), 1)
    return torch.cat(
        [
            model.proj_out(model.norm_out(x[:, :n], t))
            for x, n, t in zip(images, image_lens, pack.temb, strict=True)
        ],
        1,
    )
