"""BAGEL's step bodies: pure functions of their inputs over the shared network (a WorkPlan's ``body``).

The loops look them up here when they build a plan (``bodies.text_body``), so a test may wrap one."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from fv_bagel.mot import linear


def context(inputs: dict[str, Any]) -> dict[str, Any]:
    """The MoT's context arguments from a step's inputs: page tables into the KV pool (read one layer at a
    time, in place of a padded copy) or padded keys/values."""
    if "ctx_pages" in inputs:
        pages, valid = inputs["ctx_pages"], inputs["ctx_valid"]
        return {"ctx_valid": valid, "ctx_layer": partial(inputs["kv"].layer, pages, valid)}
    return {"ctx_k": inputs["ctx_k"], "ctx_v": inputs["ctx_v"], "ctx_valid": inputs["ctx_valid"]}


def text_body(net: Any, exact: bool, causal: bool, inputs: dict[str, Any]) -> dict[str, Any]:
    """A block of tokens per row over its context: its keys/values and the next-token logits after the
    row's last real token (``last``; without it the block's last: rows padded at their end)."""
    ids = inputs["ids"]
    t = ids.shape[1]
    mask = torch.ones(t, t, dtype=torch.bool, device=ids.device)
    mask = mask.tril() if causal else mask
    lm = net.language_model
    h, k, v = lm(
        net.embed_tokens(ids),
        inputs["pos"],
        mask,
        exact=exact,
        **context(inputs),
    )
    last = inputs.get("last")
    end = h[:, -1] if last is None else h[torch.arange(h.shape[0], device=h.device), last]
    return {"k": k, "v": v, "logits": linear(end, lm.lm_head, exact)}


def token_body(net: Any, exact: bool, inputs: dict[str, Any]) -> dict[str, Any]:
    """Token steps: a causal block per row (the last token, then any draft tokens after it) over its
    context: its keys/values and the next-token logits after every position ``[B, T, V]``."""
    ids = inputs["ids"]
    t = ids.shape[1]
    lm = net.language_model
    h, k, v = lm(
        net.embed_tokens(ids),
        inputs["pos"],
        torch.ones(t, t, dtype=torch.bool, device=ids.device).tril(),
        exact=exact,
        **context(inputs),
    )
    return {"k": k, "v": v, "logits": linear(h, lm.lm_head, exact)}


def vit_body(net: Any, exact: bool, inputs: dict[str, Any]) -> dict[str, Any]:
    """One image for understanding: SigLIP tokens between the vision markers, prefilled in full attention."""
    markers = net.embed_tokens(inputs["ids"])  # [1, 2]
    vit = net.vit_embeds(inputs["patches"][0], inputs["vit_ids"][0])[None].to(markers.dtype)
    h = torch.cat([markers[:, :1], vit, markers[:, 1:]], dim=1)
    mask = torch.ones(h.shape[1], h.shape[1], dtype=torch.bool, device=h.device)
    _, k, v = net.language_model(h, inputs["pos"], mask, exact=exact, **context(inputs))
    return {"k": k, "v": v}


def denoise_body(net: Any, exact: bool, inputs: dict[str, Any]) -> dict[str, Any]:
    """Velocity of the latent tokens ``[R, N, p*p*C]`` at flow time ``t`` over each row's context, and
    the block's keys/values (a denoise step drops them; a clean image at ``t = 0`` appends them)."""
    x, t = inputs["latents"], inputs["t"]
    markers = net.embed_tokens(inputs["ids"])  # [R, 2]
    lat = net.latent_embeds(x, t, inputs["grid"][0], exact).to(markers.dtype)
    h = torch.cat([markers[:, :1], lat, markers[:, 1:]], dim=1)
    n = h.shape[1]
    gen = torch.zeros(h.shape[:2], dtype=torch.bool, device=h.device)
    gen[:, 1:-1] = True
    mask = torch.ones(n, n, dtype=torch.bool, device=h.device)
    out, k, v = net.language_model(h, inputs["pos"], mask, gen=gen, exact=exact, **context(inputs))
    return {"velocity": linear(out[:, 1:-1], net.llm2vae, exact).float(), "k": k, "v": v}


def encode_body(vae: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    """Images ``[B, 3, H, W]`` in -1..1 to FLUX latents, a draw from the posterior with the given noise
    (BAGEL's encode samples), normalised as BAGEL does: ``scale * (z - shift)``."""
    dist = vae.encode(inputs["pixels"].to(vae.dtype)).latent_dist
    z = dist.mean + dist.std * inputs["noise"].to(vae.dtype)
    return {"latent": ((z - vae.config.shift_factor) * vae.config.scaling_factor).float()}


def decode_body(vae: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    """FLUX latents ``[B, C, h, w]`` to images ``[B, H, W, 3]`` in 0..1 (BAGEL's decode_image)."""
    z = inputs["latents"].to(vae.dtype)
    image = vae.decode(z / vae.config.scaling_factor + vae.config.shift_factor).sample
    return {"frames": (image * 0.5 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).float()}
