"""C0 (components) against diffusers' QwenImagePipeline on the tiny checkpoint: the text encoder's
features (template and its dropped tokens), one transformer call through the block seam, the VAE
decode and the schedule (dynamic shift mu)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift as diffusers_shift
from diffusers.pipelines.qwenimage.pipeline_qwenimage import retrieve_timesteps

from fv_core import ConfigError
from fv_qwen_image.bodies import decode_body, encode_body, pack, unpack
from fv_qwen_image.t2i_loop import calculate_shift, schedule, true_cfg
from fv_qwen_image.text_cache import tokenize
from fv_qwen_image.tiny import QWEN_SCHEDULER_CONFIG
from fv_qwen_image.transformer import qwen_forward
from fv_qwen_image.vae import decode_image

PROMPTS = ["a red cat on a wooden table", " ", "x" * 1200]  # the last is cut at 1024 + 34 tokens


@pytest.mark.parametrize("max_length", [512, 20])
def test_c0_text_features(tiny_model, pipe, max_length):
    inst = tiny_model.instance
    for prompt in PROMPTS:
        ids = tokenize(inst.component("tokenizer"), prompt)
        with torch.no_grad():
            ours = encode_body(inst.component("text_encoder"), {"input_ids": ids})["embeds"][:, :max_length]
            ref, mask = pipe.encode_prompt(prompt, max_sequence_length=max_length)
        assert mask is None and torch.equal(ours, ref), prompt[:20]
    assert ids.shape[1] == 1024 + 34


def test_c0_transformer_call_through_the_block_seam(tiny_model, pipe):
    g = torch.Generator().manual_seed(1)
    latents, text = torch.randn(2, 4 * 6, 64, generator=g), torch.randn(2, 9, 32, generator=g)
    model, seen = tiny_model.instance.component("transformer"), []

    class Hook:  # a block hook that records the blocks it runs
        def run(self, branch, hidden, num_blocks, block):
            for index in range(num_blocks):
                seen.append(index)
                hidden = block(index, hidden)
            return hidden

    for t in (torch.tensor([0.999, 0.25]), torch.tensor([0.5, 0.5])):
        with torch.no_grad():
            ours = qwen_forward(model, latents, t, text, (1, 4, 6))
            hooked = qwen_forward(model, latents, t, text, (1, 4, 6), hook=Hook())
            ref = pipe.transformer(
                hidden_states=latents,
                timestep=t,
                encoder_hidden_states=text,
                img_shapes=[[(1, 4, 6)]] * 2,
                return_dict=False,
            )[0]
        assert torch.equal(ours, ref) and torch.equal(hooked, ref)
    assert seen == [0, 1, 0, 1]


def test_c0_vae_decode(tiny_model, pipe):
    z = torch.randn(1, 1, 16, 4, 6, generator=torch.Generator().manual_seed(2))
    packed = pack(z)
    assert torch.equal(packed, pipe._pack_latents(z, 1, 16, 4, 6))
    assert torch.equal(unpack(packed, 4, 6), pipe._unpack_latents(packed, 32, 48, 8))
    with torch.no_grad():
        ours = decode_body(tiny_model.instance.component("vae"), {"latents": packed, "size": (4, 6)})[
            "frames"
        ]
        vae = pipe.vae
        mean = torch.tensor(vae.config.latents_mean).view(1, 16, 1, 1, 1)
        std = 1.0 / torch.tensor(vae.config.latents_std).view(1, 16, 1, 1, 1)
        image = vae.decode(unpack(packed, 4, 6) / std + mean, return_dict=False)[0][:, :, 0]
        ref = pipe.image_processor.postprocess(image, output_type="np")
        stock = decode_image(vae, unpack(packed, 4, 6) / std + mean)  # diffusers' own modules, no frame cache
    assert torch.equal(stock, vae.decode(unpack(packed, 4, 6) / std + mean, return_dict=False)[0])
    # fv's VAE convolves the one frame in 2D (vae.py: the time taps over the zero padding skipped): the
    # same function, summed in another order
    assert ours.shape == (1, 1, 32, 48, 3)
    assert np.abs(ours[:, 0].numpy() - ref).max() <= tiny_model.card.parity.tolerances["frames"]


def test_the_one_frame_convolutions_equal_diffusers_causal_ones(pipe):
    """Every causal convolution of the VAE (3x3x3 and 1x1x1) on one frame: the 2D shortcut vs diffusers'
    padded 3D kernel, encode and decode."""
    import copy

    from fv_qwen_image.vae import encode_image, frame_convolutions

    fast = frame_convolutions(copy.deepcopy(pipe.vae))
    z = torch.randn(1, 16, 1, 4, 6, generator=torch.Generator().manual_seed(3))
    x = torch.rand(1, 3, 1, 32, 48, generator=torch.Generator().manual_seed(4)) * 2 - 1
    with torch.no_grad():
        decoded = decode_image(fast, z) - pipe.vae.decode(z, return_dict=False)[0]
        encoded = encode_image(fast, x) - pipe.vae.encode(x).latent_dist.mode()
        assert torch.equal(encode_image(pipe.vae, x), pipe.vae.encode(x).latent_dist.mode())
    assert 0 < decoded.abs().max() < 1e-5 and encoded.abs().max() < 1e-5


@pytest.mark.parametrize("steps", [2, 4, 50])
@pytest.mark.parametrize("tokens", [16, 4096, 6889])
def test_c0_schedule_with_dynamic_shift(steps, tokens):
    from diffusers import FlowMatchEulerDiscreteScheduler

    config = QWEN_SCHEDULER_CONFIG
    ref = FlowMatchEulerDiscreteScheduler.from_config(config)
    mu = diffusers_shift(tokens, 256, 8192, 0.5, 0.9)
    assert calculate_shift(tokens, config) == mu
    timesteps, _ = retrieve_timesteps(ref, steps, sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    ours_t, ours_s = schedule(config, steps, tokens)
    assert torch.equal(ours_t, timesteps) and torch.equal(ours_s, ref.sigmas)
    assert abs(float(ours_s[-2]) - 0.02) < 1e-6  # stretched to the terminal sigma


def test_one_step_is_refused_where_the_schedule_is_stretched():
    with pytest.raises(
        ConfigError, match="num_inference_steps=1.*shift_terminal=0.02.*Fix: use num_inference_steps=2"
    ):
        schedule(QWEN_SCHEDULER_CONFIG, 1, 16)
    timesteps, sigmas = schedule({**QWEN_SCHEDULER_CONFIG, "shift_terminal": None}, 1, 16)
    assert timesteps.isfinite().all() and len(sigmas) == 2


def test_true_cfg_rescales_to_the_conditional_norm():
    g = torch.Generator().manual_seed(3)
    cond, uncond = torch.randn(1, 5, 8, generator=g), torch.randn(1, 5, 8, generator=g)
    out = true_cfg(cond, uncond, 4.0)
    assert torch.allclose(out.norm(dim=-1), cond.norm(dim=-1), atol=1e-6)
    assert not torch.allclose(out, cond) and torch.allclose(
        out / out.norm(dim=-1, keepdim=True),
        (uncond + 4 * (cond - uncond)) / (uncond + 4 * (cond - uncond)).norm(dim=-1, keepdim=True),
        atol=1e-6,
    )
