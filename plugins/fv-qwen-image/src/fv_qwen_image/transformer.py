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

from dataclasses import dataclass

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


def prepare(
    model,
    latents: torch.Tensor,
    timestep: torch.Tensor,
    text: torch.Tensor,
    grid: tuple[int, int, int],
    mask: torch.Tensor | None = None,
) -> Prepared:
    """``latents`` [B, tokens, C] packed, ``timestep`` [B] in 0..1, ``text`` [B, L, text_dim] (``mask``
    [B, L] bool: the valid positions; None: all), ``grid`` (frames, height, width) of the patched latents."""
    image = model.img_in(latents)
    timestep = timestep.to(image.dtype)
    context = model.txt_in(model.txt_norm(text))
    temb = model.time_text_embed(timestep, image)
    rotary = model.pos_embed([grid], max_txt_seq_len=text.shape[1], device=image.device)
    return Prepared(torch.cat([context, image], 1), text.shape[1], temb, rotary, mask)


def run_blocks(
    model, prep: Prepared, hook: BlockHook | BlockHooks | None = None, branch: str = "main"
) -> torch.Tensor:
    """``for block in blocks`` through the block seam (``hook``: a block interceptor, per CFG ``branch``)."""
    split = prep.text_len

    def block(index: int, hidden: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        temb, mask = prep.temb, prep.mask
        if rows is not None:  # a batched block hook runs these rows only
            temb = temb.index_select(0, rows.to(temb.device))
            mask = None if mask is None else mask.index_select(0, rows.to(mask.device))
        context, image = model.transformer_blocks[index](
            hidden_states=hidden[:, split:],
            encoder_hidden_states=hidden[:, :split],
            encoder_hidden_states_mask=mask,
            temb=temb,
            image_rotary_emb=prep.rotary,
        )
        return torch.cat([context, image], 1)

    return drive_blocks(hook, branch, prep.hidden, len(model.transformer_blocks), block)


def finish(model, prep: Prepared, hidden: torch.Tensor) -> torch.Tensor:
    """Output norm modulated by the timestep, then the projection, on the image stream: [B, tokens, C]."""
    return model.proj_out(model.norm_out(hidden[:, prep.text_len :], prep.temb))


def qwen_forward(
    model,
    latents: torch.Tensor,
    timestep: torch.Tensor,
    text: torch.Tensor,
    grid: tuple[int, int, int],
    hook: BlockHook | BlockHooks | None = None,
    branch: str = "main",
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Flow velocity [B, tokens, C] (what ``model(hidden_states=latents, timestep=timestep,
    encoder_hidden_states=text, encoder_hidden_states_mask=mask, img_shapes=[[grid]] * B)`` computes)."""
    prep = prepare(model, latents, timestep, text, grid, mask)
    return finish(model, prep, run_blocks(model, prep, hook, branch))
