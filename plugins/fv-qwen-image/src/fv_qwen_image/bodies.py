"""Qwen-Image's step bodies: pure functions of their inputs over shared weights, so the runtime may
batch equal-keyed plans of different requests.

``encode_body`` (Qwen2.5-VL's last hidden states, the template's tokens dropped), ``denoise_body``
(one flow velocity, or one per true-CFG branch) and ``decode_body`` (the VAE).
"""

from __future__ import annotations

from typing import Any

import torch

from fv_core.extend import BLOCKS_INPUT
from fv_core.loop import SEGMENTS
from fv_qwen_image.transformer import qwen_forward, qwen_forward_packed
from fv_qwen_image.vae import decode_image

# the prompt template diffusers' QwenImagePipeline wraps every prompt in, and how many of its leading
# tokens it drops from the encoder's output (prompt_template_encode, prompt_template_encode_start_idx)
TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
DROP = 34


def encode_body(text_encoder, inputs: dict[str, Any]) -> dict[str, Any]:
    """The language model's last hidden states of the templated prompts (rows of one length, no
    padding), without the template's first ``DROP`` tokens: ``embeds`` [B, tokens - DROP, dim]."""
    ids = inputs["input_ids"].to(text_encoder.device)
    mask = torch.ones_like(ids)
    out = text_encoder.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    return {"embeds": out.hidden_states[-1][:, DROP:]}


def text_mask(lengths: torch.Tensor, padded: int) -> torch.Tensor | None:
    """[B, padded] True on each row's first ``lengths[b]`` positions; None when every row fills them
    (a request alone, or prompts of one length: no mask, as diffusers runs one prompt)."""
    if bool((lengths == padded).all()):
        return None
    return torch.arange(padded, device=lengths.device)[None] < lengths[:, None]


def denoise_body(transformer, inputs: dict[str, Any], packed=None, exact: bool = False) -> dict[str, Any]:
    """Flow velocity of packed ``latents`` [B, tokens, C] at ``timestep`` [B] (0..1) under ``text``;
    with ``neg_text``, one forward per true-CFG branch. Rows of other prompt lengths come zero-padded
    (``<name>_len``: each row's own length). ``inputs[BLOCKS_INPUT]``: the request's block hook when a
    block interceptor is on (else None). A packed call (``inputs[SEGMENTS]``, requests of any size as
    one sequence) runs on the ``packed`` attention kernel: :func:`packed_denoise_body` (``exact``: each
    request's rows bit for bit alone)."""
    if SEGMENTS in inputs:
        return packed_denoise_body(transformer, inputs, packed, exact)
    latents, t, grid, hook = inputs["latents"], inputs["timestep"], inputs["grid"], inputs.get(BLOCKS_INPUT)

    def forward(text: str, branch: str) -> torch.Tensor:
        embeds = inputs[text]
        mask = text_mask(inputs[f"{text}_len"].to(embeds.device), embeds.shape[1])
        return qwen_forward(transformer, latents, t, embeds, grid, hook=hook, branch=branch, mask=mask)

    if "neg_text" in inputs:
        return {"cond": forward("text", "cond"), "uncond": forward("neg_text", "uncond")}
    return {"velocity": forward("text", "main")}


def packed_denoise_body(transformer, inputs: dict[str, Any], kernel, exact: bool = False) -> dict[str, Any]:
    """:func:`denoise_body` of requests packed as one sequence: ``latents`` [1, sum tokens, C], ``text``
    (and ``neg_text``) [1, sum prompt tokens, dim], ``timestep`` [N], ``grid`` one per request, their
    lengths in ``inputs[SEGMENTS]``. With block hooks (interceptors), each request runs apart with its
    own hook."""
    seg, hooks = inputs[SEGMENTS], inputs.get(BLOCKS_INPUT)
    image_lens, t = list(seg["latents"]), inputs["timestep"]
    branches = [("text", "cond"), ("neg_text", "uncond")] if "neg_text" in inputs else [("text", "main")]
    out = {}
    for text, branch in branches:
        if hooks is None:
            lens = list(seg[text])
            out[branch] = qwen_forward_packed(
                transformer,
                inputs["latents"],
                t,
                inputs[text],
                inputs["grid"],
                image_lens,
                lens,
                kernel,
                exact,
            )
            continue
        parts = zip(
            inputs["latents"].split(image_lens, 1), inputs[text].split(list(seg[text]), 1), strict=True
        )
        out[branch] = torch.cat(
            [
                qwen_forward(transformer, lat, t[i : i + 1], txt, inputs["grid"][i], hook, branch)
                for i, ((lat, txt), (hook, _)) in enumerate(zip(parts, hooks.members, strict=True))
            ],
            1,
        )
    return {"velocity": out["main"]} if "main" in out else out


def unpack(latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Packed latents [B, (h/2)(w/2), 4C] to the VAE's [B, C, 1, h, w] (h, w: latent rows, columns)."""
    b, _, channels = latents.shape
    x = latents.view(b, height // 2, width // 2, channels // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, channels // 4, 1, height, width)


def pack(latents: torch.Tensor) -> torch.Tensor:
    """[B, 1, C, h, w] noise to the transformer's packed [B, (h/2)(w/2), 4C] (2x2 patches)."""
    b, _, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def decode_body(vae, inputs: dict[str, Any]) -> dict[str, Any]:
    """Unpack, un-normalise with the VAE's latent statistics, decode, map to ``frames`` [B, 1, H, W, 3]
    in 0..1 (``size``: the latent rows and columns)."""
    z = unpack(inputs["latents"], *inputs["size"]).to(vae.dtype)
    c = vae.config
    mean = torch.tensor(c.latents_mean).view(1, c.z_dim, 1, 1, 1).to(z.device, z.dtype)
    inv_std = 1.0 / torch.tensor(c.latents_std).view(1, c.z_dim, 1, 1, 1).to(z.device, z.dtype)
    image = decode_image(vae, z / inv_std + mean)[:, :, 0]
    return {"frames": (image * 0.5 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).float().unsqueeze(1)}
