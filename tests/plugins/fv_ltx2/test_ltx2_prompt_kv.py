"""The prompt's keys/values computed once per request: bit for bit the text path's, in one call and
through the loop, and cached by prompt and transformer version (a weight sync never serves stale ones)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import fv_core
from fv_core.runtime import Engine
from fv_core.training import WeightSyncPlan, sync_weights
from fv_ltx2.prompt_kv import prompt_kv
from fv_ltx2.steps import denoise_body, encode_body
from fv_ltx2.t2av_loop import LTX2Loop

ASK = dict(num_inference_steps=2, negative_prompt="blurry")


@pytest.fixture
def model(ltx_host, ltx_path):
    return fv_core.load("ltx2-tiny", ltx_path, host=ltx_host)


def run(model, prompt: str, seed: int = 1):
    """The request's denoised latents (the loop stops before decoding, as a program's base stage does)."""
    request = model.prepare({"prompt": prompt, "seed": seed, **ASK})
    with torch.no_grad():
        return Engine().run_one(*model.job(replace(request, carry={"latents_out": True})))


def test_a_call_on_cached_keys_values_equals_the_call_on_the_text(model):
    inst = model.instance
    tok, transformer = inst.component("tokenizer"), inst.component("transformer")
    enc = tok(
        ["blurry", "a cat"], padding="max_length", max_length=128, return_tensors="pt", padding_side="left"
    )
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        text = encode_body(inst.component("text_encoder"), inst.component("connectors"),
                           {"input_ids": enc.input_ids, "mask": enc.attention_mask})  # fmt: skip
        kv = prompt_kv(transformer, text["video_text"], text["audio_text"])
        assert kv["video_kv"].shape == (2, 2, 2, 128, 16) and kv["audio_kv"].shape == (2, 2, 2, 128, 8)
        statics = dict(num_frames=2, height=2, width=2, fps=24.0, audio_num_frames=9, use_cross_timestep=True)
        for branch, rows in (("cfg", slice(None)), ("modality", slice(1, None))):
            n = len(range(2)[rows])
            inputs = dict(
                latents=torch.randn(n, 8, 4, generator=g), audio_latents=torch.randn(n, 9, 4, generator=g),
                timestep=torch.full((n,), 700.0), **{k: v[rows] for k, v in text.items()},
                video_coords=transformer.rope.prepare_video_coords(n, 2, 2, 2, "cpu", fps=24.0),
                audio_coords=transformer.audio_rope.prepare_audio_coords(n, 9, "cpu"),
            )  # fmt: skip
            statics_b = {
                **statics,
                "isolate_modalities": branch == "modality",
                "spatio_temporal_guidance_blocks": None,
            }
            on_text = denoise_body(transformer, statics_b, branch, inputs)  # diffusers' own forward
            cached = denoise_body(
                transformer, statics_b, branch, {**inputs, **{k: v[rows] for k, v in kv.items()}}
            )
            assert all(torch.equal(cached[k], on_text[k]) for k in ("video", "audio")), branch


def test_the_loop_caches_keys_values_by_prompt_and_transformer_version(
    model, ltx_host, ltx_path, monkeypatch
):
    first = run(model, "a cat playing piano")
    assert first.metrics["kv_cache_hits"] == 0 and len(model.instance.kv_cache) == 2  # prompt and negative
    assert run(model, "a cat playing piano", seed=2).metrics["kv_cache_hits"] == 2
    assert run(model, "rain on a roof").metrics["kv_cache_hits"] == 1  # the negative prompt's only
    live = model.instance.component("transformer").state_dict()
    gen = torch.Generator().manual_seed(0)
    new = {
        k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in live.items() if v.is_floating_point()
    }
    sync_weights(model, WeightSyncPlan(role="student", components=["transformer"], version="step-1"), new)
    after = run(model, "a cat playing piano")
    assert after.metrics["text_cache_hits"] == 2 and after.metrics["kv_cache_hits"] == 0
    assert not torch.equal(after.outputs["latents"], first.outputs["latents"])

    monkeypatch.setattr(LTX2Loop, "prompt_kv", False)  # the text path in every call: the same bits
    plain = fv_core.load("ltx2-tiny", ltx_path, host=ltx_host)
    same = run(plain, "a cat playing piano")
    assert same.metrics["kv_cache_hits"] == 0 and len(plain.instance.kv_cache) == 0
    plain.instance.component("transformer").load_state_dict(new, strict=False)
    for cached, on_text in ((first, same), (after, run(plain, "a cat playing piano"))):
        assert all(torch.equal(cached.outputs[k], on_text.outputs[k]) for k in ("latents", "audio_latents"))
