"""C0 (components) and C1 (full loop) parity against diffusers' WanPipeline on the tiny checkpoint."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler
from wan_support import BASE, NEGATIVE, PROMPT, run

from fv_wan.bodies import decode_body, encode_body
from fv_wan.samplers import FlowEuler, Schedule, UniPC
from fv_wan.tiny import WAN_SCHEDULER_CONFIG
from fv_wan.transformer import wan_forward


def test_c0_encoder(tiny_model, pipe):
    tok = tiny_model.component("tokenizer")
    enc = tok([PROMPT, NEGATIVE], padding="max_length", max_length=64, truncation=True, return_tensors="pt")
    with torch.no_grad():
        ours = encode_body(
            tiny_model.component("text_encoder"), {"input_ids": enc.input_ids, "mask": enc.attention_mask}
        )
        pos, neg = pipe.encode_prompt(PROMPT, NEGATIVE, max_sequence_length=64)
    assert torch.equal(ours["embeds"], torch.cat([pos, neg]))


def test_c0_transformer_block_forward(tiny_model, pipe):
    g = torch.Generator().manual_seed(1)
    x, text = torch.randn(2, 16, 2, 4, 6, generator=g), torch.randn(2, 20, 32, generator=g)
    for t in (torch.tensor([999, 3]), torch.tensor([812.5, 250.0])):
        with torch.no_grad():
            ours = wan_forward(tiny_model.component("transformer"), x, t, text)
            ref = pipe.transformer(x, t, text, return_dict=False)[0]
        assert (ours - ref).abs().max() <= 1e-6


def test_c0_block_seam_sees_every_block(tiny_model):
    seen = []

    def around(index, hidden, run_block):
        seen.append(index)
        return run_block(hidden)

    model = tiny_model.component("transformer")
    x, text = torch.randn(1, 16, 1, 4, 4), torch.randn(1, 8, 32)
    with torch.no_grad():
        assert torch.equal(
            wan_forward(model, x, torch.tensor([500]), text, around),
            wan_forward(model, x, torch.tensor([500]), text),
        )
    assert seen == list(range(len(model.blocks)))


def test_c0_vae_decode(tiny_model, pipe):
    z = torch.randn(1, 16, 2, 4, 4, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = decode_body(tiny_model.component("vae"), {"latents": z})["frames"][0].numpy()
        vae = pipe.vae
        mean = torch.tensor(vae.config.latents_mean).view(1, 16, 1, 1, 1)
        std = 1.0 / torch.tensor(vae.config.latents_std).view(1, 16, 1, 1, 1)
        video = vae.decode(z / std + mean, return_dict=False)[0]
        ref = pipe.video_processor.postprocess_video(video, output_type="np")[0]
    assert np.abs(ours - ref).max() <= 1e-6


@pytest.mark.parametrize("order", [2, 3])
@pytest.mark.parametrize("steps", [1, 2, 5, 9])
def test_c0_samplers_match_diffusers_schedulers(steps, order):
    config = {**WAN_SCHEDULER_CONFIG, "solver_order": order}
    pairs = [
        (UniPCMultistepScheduler.from_config(config), UniPC(config)),
        (FlowMatchEulerDiscreteScheduler(shift=config["flow_shift"]), FlowEuler(config)),
    ]
    for ref, ours in pairs:
        ref.set_timesteps(steps)
        sched = ours.schedule(steps)
        assert torch.equal(ref.timesteps, sched.timesteps) and torch.equal(ref.sigmas, sched.sigmas)
        g = torch.Generator().manual_seed(steps)
        x = torch.randn(1, 16, 2, 4, 4, generator=g)
        y, tensors, values = x.clone(), {}, {}
        for i, t in enumerate(ref.timesteps):
            v = torch.randn(x.shape, generator=g)
            x = ref.step(v, t, x, return_dict=False)[0]
            y = ours.step(tensors, values, Schedule(sched.timesteps, sched.sigmas), i, v, y)
        assert torch.equal(x, y)


@pytest.mark.parametrize("cfg_mode,tol", [("two_forward", 1e-5), ("batched", 1e-4)])
@pytest.mark.parametrize("sampler", ["unipc", "euler"])
def test_c1_loop_matches_wan_pipeline(tiny_model, pipe, tiny_path, sampler, cfg_mode, tol):
    unipc = pipe.scheduler
    pipe.scheduler = unipc if sampler == "unipc" else FlowMatchEulerDiscreteScheduler(shift=3.0)
    try:
        ref = pipe(
            PROMPT,
            negative_prompt=NEGATIVE,
            num_frames=BASE["num_frames"],
            height=BASE["height"],
            width=BASE["width"],
            num_inference_steps=BASE["num_inference_steps"],
            guidance_scale=BASE["guidance_scale"],
            generator=torch.Generator().manual_seed(11),
            output_type="np",
        ).frames[0]
    finally:
        pipe.scheduler = unipc
    ours = run(tiny_model, seed=11, sampler=sampler, cfg_mode=cfg_mode).outputs["frames"].numpy()
    assert ours.shape == ref.shape == (5, 32, 48, 3)
    assert np.abs(ours - ref).max() <= tol
    assert (
        tiny_model.card.parity.tolerances["frames" if cfg_mode == "two_forward" else "frames_batched_cfg"]
        >= tol
    )


def test_c1_without_guidance(tiny_model, pipe):
    ref = pipe(
        PROMPT,
        num_frames=1,
        height=32,
        width=32,
        num_inference_steps=2,
        guidance_scale=1.0,
        generator=torch.Generator().manual_seed(3),
        output_type="np",
    ).frames[0]
    result = run(
        tiny_model,
        seed=3,
        num_frames=1,
        height=32,
        width=32,
        num_inference_steps=2,
        guidance_scale=1.0,
        task="t2i",
    )
    assert result.metrics["cfg"] == "off"
    assert np.abs(result.outputs["frames"].numpy() - ref).max() <= 1e-5
