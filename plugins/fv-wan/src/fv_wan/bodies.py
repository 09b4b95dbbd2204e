"""The Wan loops' step bodies: pure functions of their inputs over shared weights, so the runtime may
batch equal-keyed plans of different requests, and training runs the very forward a server runs.

``encode_body`` (UMT5), ``text_kv_body`` (every block's cross-attention keys/values of the prompt),
``denoise_body`` (one flow velocity, or two under two-forward CFG) and ``decode_body`` (the VAE) serve
``fv_wan.t2v_loop.WanLoop``; ``chunk_decode_body`` decodes causal Wan's chunks one after another.
"""

from __future__ import annotations

from typing import Any

import torch

from fv_core.extend import BLOCKS_INPUT
from fv_core.loop import SEGMENTS
from fv_wan import conditioning
from fv_wan.packed import wan_forward_packed
from fv_wan.transformer import folded_text_kv, image_kv, text_kv, wan_forward_kv

# Most bytes of decoded frames one VAE call makes. The decode's working set grows with the rows of a
# call, several times their output; its speed hardly does past two rows. Measured on the medium bench
# (8 videos of 9 x 64 x 64, 0.42 MiB each): one call 351 ms and 31 MiB peak, calls of 2 rows 379 ms
# and 9 MiB, one by one 510 ms.
DECODE_BYTES = 1 << 20


def encode_body(text_encoder, inputs: dict[str, Any]) -> dict[str, Any]:
    """UMT5 last hidden states, zeroed past each prompt's length (as Wan's pipeline does)."""
    mask = inputs["mask"].to(text_encoder.device)
    hidden = text_encoder(inputs["input_ids"].to(text_encoder.device), mask).last_hidden_state
    return {"embeds": torch.where(mask.bool().unsqueeze(-1), hidden, torch.zeros((), dtype=hidden.dtype))}


def denoise_body(transformer, inputs: dict[str, Any], packed=None, invariant: bool = False) -> dict[str, Any]:
    """Flow velocity; with ``neg_kv`` present, one forward per CFG branch (two-forward CFG);
    ``invariant``: each batched row's bits as alone (the plan's ``invariant_body``, see fv_wan.transformer).

    ``inputs[BLOCKS_INPUT]``: the request's block hook when a block interceptor is on (else None);
    ``inputs["branch_suffix"]`` keeps a second expert's block caches apart from the first's. A plan in
    the packed form (flattened ``latents`` beside their ``shape``) runs :func:`packed_denoise_body`
    on the ``packed`` attention kernel.
    """
    if "shape" in inputs:
        return packed_denoise_body(transformer, inputs, packed)
    latents, t, hook = inputs["latents"], inputs["timestep"], inputs.get(BLOCKS_INPUT)
    suffix, img_kv, length = inputs.get("branch_suffix", ""), inputs.get("img_kv"), inputs.get("kv_length", 0)

    def forward(kv: str, branch: str) -> torch.Tensor:
        return wan_forward_kv(
            transformer,
            latents,
            t,
            inputs[kv],
            hook=hook,
            branch=branch + suffix,
            img_kv=img_kv,
            kv_rows=inputs.get(kv + "_rows"),
            kv_length=length,
            invariant=invariant,
        )

    if "neg_kv" in inputs:
        return {"cond": forward("kv", "cond"), "uncond": forward("neg_kv", "uncond")}
    return {"velocity": forward("kv", "main")}


def packed_denoise_body(transformer, inputs: dict[str, Any], kernel) -> dict[str, Any]:
    """:func:`denoise_body` of requests of any size as one sequence: ``latents`` [1, C, sum of each
    request's F x H x W] beside each request's ``shape`` (F, H, W), ``kv`` (and ``neg_kv``) laid end to end
    on the text dim, ``timestep`` [N]; velocities come back flattened the same way. A plan alone, or
    one with block hooks (interceptors), runs each request through the plain forward with its own hook."""
    seg = inputs.get(SEGMENTS)
    alone = seg is None
    shapes = [inputs["shape"]] if alone else list(inputs["shape"])
    tokens = [s[0] * s[1] * s[2] for s in shapes]
    latents = [x.unflatten(2, s) for x, s in zip(inputs["latents"].split(tokens, 2), shapes, strict=True)]
    lengths = [inputs["kv_length"]] if alone else list(inputs["kv_length"]) if "kv_length" in inputs else None
    hooks = inputs.get(BLOCKS_INPUT)
    members = [hooks] if alone else [None] * len(shapes) if hooks is None else [h for h, _ in hooks.members]
    suffix, t = inputs.get("branch_suffix", ""), inputs["timestep"]

    def forward(name: str, branch: str) -> torch.Tensor:
        kv = inputs[name].split([inputs[name].shape[3]] if alone else list(seg[name]), 3)
        rows = inputs.get(name + "_rows")
        rows_i = [None] * len(kv) if rows is None else list(rows.split(1))
        if alone or hooks is not None:
            out = [
                wan_forward_kv(
                    transformer,
                    x,
                    t[i : i + 1],
                    kv[i],
                    hook=members[i],
                    branch=branch + suffix,
                    kv_rows=rows_i[i],
                    kv_length=lengths[i] if lengths else 0,
                )
                for i, x in enumerate(latents)
            ]
        else:
            out = wan_forward_packed(transformer, latents, t, list(kv), kernel, rows_i, lengths)
        return torch.cat([v.flatten(2) for v in out], 2)

    if "neg_kv" in inputs:
        return {"cond": forward("kv", "cond"), "uncond": forward("neg_kv", "uncond")}
    return {"velocity": forward("kv", "main")}


def text_kv_body(transformer, inputs: dict[str, Any]) -> dict[str, Any]:
    """Every block's cross-attention keys/values for the prompt embeddings (step-invariant; with
    ``inputs["fold"]``, folded: ``kv`` and ``kv_rows``), and for the image features when there are
    any (Wan2.1 I2V)."""
    if inputs.get("fold"):
        kv, rows = folded_text_kv(transformer, inputs["text"])
        out = {"kv": kv, "kv_rows": rows}
    else:
        out = {"kv": text_kv(transformer, inputs["text"])}
    if "image" in inputs:
        out["img_kv"] = image_kv(transformer, inputs["image"])
    return out


def decode_body(vae, inputs: dict[str, Any]) -> dict[str, Any]:
    """Un-normalise latents, VAE decode, map to frames [B, F, H, W, 3] in 0..1; a batch of latents
    decodes in row groups of at most DECODE_BYTES of frames (one row at least)."""
    z = inputs["latents"].to(vae.dtype)
    mean, inv_std = conditioning.latent_stats(vae, z)
    size = max(1, DECODE_BYTES // decoded_row_bytes(vae, z))
    frames = [_decode_rows(vae, z[start : start + size], mean, inv_std) for start in range(0, len(z), size)]
    return {"frames": frames[0] if len(frames) == 1 else torch.cat(frames)}


def _decode_rows(vae, z: torch.Tensor, mean: torch.Tensor, inv_std: torch.Tensor) -> torch.Tensor:
    video = vae.decode(z / inv_std + mean, return_dict=False)[0]
    return video.mul_(0.5).add_(0.5).clamp_(0, 1).permute(0, 2, 3, 4, 1).float()


def decoded_row_bytes(vae, z: torch.Tensor) -> int:
    """Bytes of one row's decoded video for latents ``z`` [B, C, F, H, W] (a patched VAE's output
    channels are pixels of its patches)."""
    c = vae.config
    frames = (z.shape[2] - 1) * c.scale_factor_temporal + 1
    pixels = z.shape[3] * z.shape[4] * c.scale_factor_spatial**2
    return c.out_channels // (c.get("patch_size") or 1) ** 2 * frames * pixels * z.element_size()


# ---- causal Wan: a chunk's frames, carrying the decoder's causal cache ----


def decoder_convs(vae) -> int:
    """Causal convolutions of the VAE decoder (the length of its per-frame feature cache)."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

    return sum(isinstance(m, WanCausalConv3d) for m in vae.decoder.modules())


def chunk_decode_body(vae, inputs: dict[str, Any]) -> dict[str, Any]:
    """Chunks' latents [B, C, n, h, w] (one row per request) to their frames [B, F, H, W, 3] in 0..1, frame
    by frame, carrying the decoder's causal feature cache as the VAE's own decode does across a whole
    video: ``cache_markers`` (None for a first chunk) lists each cache entry, ``"tensor"`` for the rows'
    tensors under ``cache.<i>`` [B, ...], else the entry itself; the new cache comes back the same way."""
    z = inputs["latents"].to(vae.dtype)
    mean, inv_std = conditioning.latent_stats(vae, z)
    x = vae.post_quant_conv(z / inv_std + mean)
    markers = inputs.get("cache_markers")
    first = markers is None
    cache = [None] * decoder_convs(vae) if first else [
        inputs[f"cache.{i}"] if m == "tensor" else m for i, m in enumerate(markers)
    ]  # fmt: skip
    outs = []
    for i in range(x.shape[2]):
        out = vae.decoder(x[:, :, i : i + 1], feat_cache=cache, feat_idx=[0], first_chunk=first and i == 0)
        outs.append(out)
    video = torch.cat(outs, 2)
    if vae.config.patch_size is not None:
        from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

        video = unpatchify(video, patch_size=vae.config.patch_size)
    video = video.clamp(-1.0, 1.0)
    frames = (video * 0.5 + 0.5).clamp(0, 1).permute(0, 2, 3, 4, 1).float()
    kept = {f"cache.{i}": e for i, e in enumerate(cache) if isinstance(e, torch.Tensor)}
    new_markers = tuple("tensor" if isinstance(e, torch.Tensor) else e for e in cache)
    return {"frames": frames, **kept, "cache_markers": new_markers}
