"""LoRA adapters per request on LTX-2: C1 against diffusers' ``load_lora_weights`` + ``set_adapters`` on the
same weights and seed (a diffusers-format LoRA on both streams with a saved alpha, LTX-2's own
``diffusion_model.`` / ``text_embedding_projection.`` format, the two combined), a Gemma LoRA against PEFT
on diffusers' text encoder, i2av, requests with different adapters (and none) in one batched call (FBCache
on too), the text cache keyed by adapter, the two-stage program with an adapter on top of the refine LoRA,
and a Wan LoRA refused."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from diffusers import LTX2Pipeline
from safetensors.torch import save_file

import fv_core
from fv_core import ConfigError
from fv_core.adapters import random_lora
from fv_core.parity import check_batched_parity, compare_results
from fv_core.runtime import Engine
from fv_core.runtime.policy import SchedulingPolicy
from fv_ltx2.cards import REFINE_LORA
from fv_ltx2.program import GUIDANCE_OFF, RESCALE_OFF
from fv_ltx2.tiny import distilled_lora

ASK = {"prompt": "a dog barking in the rain", "negative_prompt": "blurry", "num_inference_steps": 2}
# both streams' attentions (self, text, audio<->video) and feed-forwards, the audio input and caption
# projections, both time embeddings (the video one per token in i2av)
AV_TARGETS = (
    "attn1.to_q", "attn2.to_k", "audio_to_video_attn.to_v", "video_to_audio_attn.to_out.0", "ff.net.0.proj",
    "audio_ff.net.2", "audio_proj_in", "audio_caption_projection.linear_1", "time_embed.linear",
)  # fmt: skip


@pytest.fixture(scope="module")
def model(ltx_host, ltx_path):
    return fv_core.load("ltx2-tiny", ltx_path, host=ltx_host)


@pytest.fixture(scope="module")
def pipe(ltx_path):
    pipe = LTX2Pipeline.from_pretrained(ltx_path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def lora_files(model, tmp_path_factory):
    """``av``: diffusers' format (saved by LTX2Pipeline with lora_alpha 8, r 4) on both streams; ``own``:
    LTX-2's own keys (the transformer's ``diffusion_model.`` as tiny.py's refine LoRA writes them, renamed
    top-level audio modules, the connectors' ``text_embedding_projection.``); ``te``: Gemma's attention."""
    root = tmp_path_factory.mktemp("loras")
    dit = model.instance.component("transformer")
    av = {k.removeprefix("transformer."): v for k, v in random_lora(dit, AV_TARGETS, seed=1, std=0.2).items()}
    modules = sorted({k.rpartition(".lora_")[0] for k in av})
    LTX2Pipeline.save_lora_weights(
        root / "av",
        av,
        transformer_lora_adapter_metadata={"r": 4, "lora_alpha": 8, "target_modules": modules},
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(2)
        own = {k: v * 10 for k, v in distilled_lora(dit).items()}
    g = torch.Generator().manual_seed(3)
    for name, (fan_in, fan_out) in {
        "diffusion_model.audio_patchify_proj": (
            dit.audio_proj_in.in_features,
            dit.audio_proj_in.out_features,
        ),
        "diffusion_model.audio_adaln_single.linear": tuple(dit.audio_time_embed.linear.weight.shape[::-1]),
        "text_embedding_projection.aggregate_embed": tuple(
            model.instance.component("connectors").text_proj_in.weight.shape[::-1]
        ),
    }.items():
        own[f"{name}.lora_A.weight"] = torch.randn(4, fan_in, generator=g) * 0.2
        own[f"{name}.lora_B.weight"] = torch.randn(fan_out, 4, generator=g) * 0.2
    save_file(own, root / "own.safetensors")
    encoder = model.instance.component("text_encoder")
    te = random_lora(
        encoder, ("self_attn.q_proj", "self_attn.v_proj"), rank=2, seed=4, prefix="text_encoder", std=0.5
    )
    te = {k: v for k, v in te.items() if ".language_model." in k}
    save_file(te, root / "te.safetensors")
    return {"av": root / "av" / "pytorch_lora_weights.safetensors", "own": root / "own.safetensors",
            "te": root / "te.safetensors"}  # fmt: skip


@pytest.fixture(scope="module")
def plane(model, lora_files):
    for name, path in lora_files.items():
        model.instance.adapters.add(name, path)
    return model.instance.adapters


def ours(model, adapters=(), seed=5, **params) -> tuple[torch.Tensor, torch.Tensor]:
    """fv's video and audio latents (the loop run to latents, as the two-stage base stage runs it)."""
    request = model.prepare({**ASK, "seed": seed, **params}, adapters=adapters)
    with torch.no_grad():
        result = Engine().run_one(*model.job(replace(request, carry={"latents_out": True})))
    return result.outputs["latents"], result.outputs["audio_latents"]


def reference(model, pipe, loras: dict, scales: list[float], seed=5) -> tuple[torch.Tensor, torch.Tensor]:
    """Diffusers' latents with ``loras`` loaded and set to ``scales``, on fv's resolved params."""
    p = model.prepare({**ASK, "seed": seed}).params.model_dump()
    for name, path in loras.items():
        pipe.load_lora_weights(str(path), adapter_name=name)
    pipe.set_adapters(list(loras), scales)
    try:
        return pipe(
            **call_args(p),
            generator=torch.Generator().manual_seed(seed),
            output_type="latent",
            return_dict=False,
        )
    finally:
        pipe.unload_lora_weights()


def call_args(p: dict) -> dict:
    """LTX2Pipeline's arguments for fv's resolved params ``p``."""
    same = ("prompt", "negative_prompt", "height", "width", "num_frames", "num_inference_steps", "guidance_scale",
            "stg_scale", "modality_scale", "guidance_rescale", "audio_guidance_scale", "audio_stg_scale",
            "audio_modality_scale", "audio_guidance_rescale", "spatio_temporal_guidance_blocks", "max_sequence_length")  # fmt: skip
    return {**{k: p[k] for k in same}, "frame_rate": p["fps"]}


def gap(a, b) -> float:
    return float((a - b).abs().max())


@pytest.fixture(scope="module")
def plain(model):
    return ours(model)


@pytest.mark.parametrize("names,scales", [(["av"], [0.8]), (["own"], [1.0]), (["av", "own"], [0.7, -0.5])])
def test_c1_adapters_match_diffusers_set_adapters(model, plane, pipe, lora_files, plain, names, scales):
    video, audio = ours(model, list(zip(names, scales, strict=True)))
    ref_video, ref_audio = reference(model, pipe, {n: lora_files[n] for n in names}, scales)
    assert gap(video, ref_video) <= 1e-5 and gap(audio, ref_audio) <= 1e-5
    assert gap(video, plain[0]) > 1e-3 and gap(audio, plain[1]) > 1e-3, "the adapter changes both streams"


def test_a_gemma_lora_matches_peft_on_diffusers_text_encoder(model, plane, pipe, lora_files, plain):
    """diffusers' LTX-2 loader reads transformer and connector LoRAs only; the reference for a Gemma LoRA
    is PEFT injected into the pipeline's own text encoder."""
    from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict
    from peft.tuners.tuners_utils import BaseTunerLayer
    from safetensors.torch import load_file

    state = {k.removeprefix("text_encoder."): v for k, v in load_file(lora_files["te"]).items()}
    names = sorted({k.rpartition(".lora_")[0] for k in state})
    inject_adapter_in_model(
        LoraConfig(r=2, lora_alpha=2, target_modules=names), pipe.text_encoder, adapter_name="te"
    )
    set_peft_model_state_dict(pipe.text_encoder, state, "te")
    try:
        p = model.prepare({**ASK, "seed": 5}).params.model_dump()
        ref = pipe(
            **call_args(p),
            generator=torch.Generator().manual_seed(5),
            output_type="latent",
            return_dict=False,
        )
    finally:
        for module in pipe.text_encoder.modules():  # back to the plain encoder for the other tests
            if isinstance(module, BaseTunerLayer):
                module.delete_adapter("te")
    video, audio = ours(model, ["te"])
    assert gap(video, ref[0]) <= 1e-5 and gap(audio, ref[1]) <= 1e-5
    assert gap(video, plain[0]) > 1e-3 and gap(audio, plain[1]) > 1e-3


def test_c1_image_to_video_with_an_adapter(model, plane, lora_files, ltx_path):
    """i2av gives each video token its own timestep: the time embedding's linears see rows x tokens."""
    from diffusers import LTX2ImageToVideoPipeline
    from PIL import Image

    from fv_core import ImagePart

    pixels = (np.random.default_rng(3).random((64, 64, 3)) * 255).round().astype(np.uint8)
    request = model.prepare({**ASK, "seed": 5}, task="i2av", parts=[ImagePart(pixels / np.float32(255))],
                            adapters=[("av", 0.8)])  # fmt: skip
    with torch.no_grad():
        got = Engine().run_one(*model.job(replace(request, carry={"latents_out": True}))).outputs
    pipe = LTX2ImageToVideoPipeline.from_pretrained(ltx_path)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(lora_files["av"]), adapter_name="av")
    pipe.set_adapters(["av"], [0.8])
    args = dict(image=Image.fromarray(pixels), **call_args(request.params.model_dump()),
                image_crf=request.params.image_crf, output_type="latent", return_dict=False)  # fmt: skip
    video, audio = pipe(**args, generator=torch.Generator().manual_seed(5))
    assert gap(got["latents"], video) <= 1e-5 and gap(got["audio_latents"], audio) <= 1e-5
    pipe.disable_lora()
    base = pipe(**args, generator=torch.Generator().manual_seed(5))
    assert gap(got["latents"], base[0]) > 1e-3, "the adapter changes the image-conditioned video"


class BatchCount:
    """An observer of how many plans each step shared its call with."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def on_step(self, state, plan, result) -> None:
        self.sizes.append(result.batched_with)


def test_different_adapters_share_one_batched_call_and_equal_their_solo_runs(model, plane):
    asks = [[("av", 0.8)], [], [("own", 1.0), ("av", 0.3)], [("te", 1.0)]]
    steps = BatchCount()

    def items():
        return [
            model.job(model.prepare({**ASK, "seed": i}, request_id=f"a{i}", adapters=a))
            for i, a in enumerate(asks)
        ]

    def engine():  # fair: every compatible step batched
        return Engine(observers=[steps], scheduling=SchedulingPolicy("fair"))

    with torch.no_grad():
        report = check_batched_parity(engine, items, tol=model.card.parity.tolerances["frames"])
    assert report.ok, str(report)
    assert max(steps.sizes) == 4, "all four requests (three adapter sets and none) shared calls"


def test_cached_requests_with_different_adapters_batch_and_equal_their_solo_cached_runs(model, plane):
    """FBCache on: a batched call runs a block for the rows that compute it only; those rows keep their
    own adapters (the rows' decisions differ, so such sub-calls happen)."""
    from fv_cache_dit import FBCache

    def items():
        asks = [[("av", 0.8)], [], [("own", 1.0)]]
        return [
            model.job(
                model.prepare(
                    {**ASK, "num_inference_steps": 4, "seed": i + 1}, request_id=f"c{i}", adapters=a
                )
            )
            for i, a in enumerate(asks)
        ]

    cache = dict(residual_diff_threshold=0.3, max_warmup_steps=1)
    steps = BatchCount()
    with torch.no_grad():
        solo = Engine(interceptors=[FBCache(**cache)]).run_serial(items())
        batched = Engine(observers=[steps], interceptors=[FBCache(**cache)]).run_batched(items())
    report = compare_results(solo, batched, "batched", tolerance=model.card.parity.tolerances["frames"])
    assert report.ok, str(report)
    stats = [r.metrics["cache_dit"] for r in batched]
    assert stats == [r.metrics["cache_dit"] for r in solo] and len({s["computed"] for s in stats}) > 1
    assert max(steps.sizes) == 3


def test_the_text_and_kv_caches_are_keyed_by_the_adapters(model, plane):
    """Text features by Gemma's and the connectors' adapters; the prompt keys/values by those and the
    transformer's too (``av`` adapts the text cross-attention's key projection)."""

    def run(adapters=()):
        request = model.prepare({**ASK, "seed": 4}, adapters=adapters)
        with torch.no_grad():
            result = Engine().run_one(*model.job(request))
        return result.outputs["frames"], result.metrics["text_cache_hits"], result.metrics["kv_cache_hits"]

    model.instance.feature_cache.invalidate()
    model.instance.kv_cache.invalidate()
    plain, hits, kv_hits = run()
    assert hits == kv_hits == 0
    for name, text_hits in (("te", 0), ("own", 0), ("av", 2)):  # Gemma's; the connectors' (+ the
        features, hits, kv_hits = run([name])  # transformer's); the transformer's alone
        assert hits == text_hits and kv_hits == 0, f"{name}: another request's cached features were served"
        assert gap(features, plain) > 1e-3
        again, hits, kv_hits = run([name])
        assert hits == kv_hits == 2 and torch.equal(again, features)
    again, hits, kv_hits = run()
    assert hits == kv_hits == 2 and torch.equal(again, plain)


def test_the_two_stage_program_runs_the_adapter_on_top_of_the_refine_lora(model, plane, lora_files, ltx_path):
    """t2av-two-stage with an adapter == diffusers' chain with that LoRA set in the base stage and set beside
    the distilled refine LoRA in the refine stage (fv merges that one; the request's stays unmerged), one
    generator through the chain."""
    from diffusers import FlowMatchEulerDiscreteScheduler, LTX2LatentUpsamplePipeline
    from diffusers.pipelines.ltx2.latent_upsampler import LTX2LatentUpsamplerModel

    got = model.generate(
        task="t2av-two-stage", prompt="a cat playing piano", height=128, width=128, num_inference_steps=2, seed=3,
        adapters=[("av", 0.6)],
    )  # fmt: skip
    p = got.provenance["params"]
    pipe = LTX2Pipeline.from_pretrained(ltx_path)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(lora_files["av"]), adapter_name="av")
    pipe.set_adapters(["av"], [0.6])
    generator = torch.Generator().manual_seed(3)
    base = {**call_args(p), "height": 64, "width": 64}
    video, audio = pipe(**base, generator=generator, output_type="latent", return_dict=False)
    upsampler = LTX2LatentUpsamplerModel.from_pretrained(f"{ltx_path}/latent_upsampler")
    video = LTX2LatentUpsamplePipeline(vae=pipe.vae, latent_upsampler=upsampler)(
        latents=video, output_type="latent", return_dict=False
    )[0]
    pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_config(
        pipe.scheduler.config, use_dynamic_shifting=False, shift_terminal=None
    )
    pipe.load_lora_weights(ltx_path, weight_name=REFINE_LORA, adapter_name="refine")
    sigmas, after_base = p["refine_sigmas"], generator.get_state()

    def refine(adapters: list[str], scales: list[float]):
        pipe.set_adapters(adapters, scales)
        generator.set_state(after_base)  # the chain's one generator, where the base stage left it
        out = pipe(
            **{**call_args(p), **GUIDANCE_OFF, **RESCALE_OFF, "num_inference_steps": len(sigmas)}, sigmas=sigmas,
            latents=video, audio_latents=audio, noise_scale=sigmas[0], generator=generator, output_type="np",
        )  # fmt: skip
        return out.frames[0], out.audio[0].float().numpy()

    frames, waveform = refine(["refine", "av"], [1.0, 0.6])
    assert abs(frames - got.frames).max() <= 1e-5 and abs(waveform - got.audio.samples).max() <= 1e-5
    without = refine(["refine"], [1.0])[0]  # the request's adapter off in the refine stage only
    assert abs(without - got.frames).max() > 1e-3, "the refine stage applies the request's adapter"


def test_a_wan_lora_is_refused_clearly(model, plane, tmp_path):
    g = torch.Generator().manual_seed(0)
    original = {}  # original Wan's layout: diffusion_model.blocks.N.self_attn.q, lora_down/up
    for i in range(2):
        for name in ("self_attn.q", "cross_attn.k", "ffn.0"):
            original[f"diffusion_model.blocks.{i}.{name}.lora_down.weight"] = torch.randn(4, 32, generator=g)
            original[f"diffusion_model.blocks.{i}.{name}.lora_up.weight"] = torch.randn(32, 4, generator=g)
    save_file(original, tmp_path / "wan.safetensors")
    with pytest.raises(ConfigError, match=r"in a layout this model's LoRA loader does not convert .*another model "
                       r"family.*Fix: use a LoRA made for this model"):  # fmt: skip
        plane.add("wan", tmp_path / "wan.safetensors")
    # diffusers' Wan keys
    wan_diffusers = {"transformer.blocks.0.attn1.to_q.lora_A.weight": torch.zeros(4, 32)}
    wan_diffusers["transformer.blocks.0.attn1.to_q.lora_B.weight"] = torch.zeros(32, 4)
    save_file(wan_diffusers, tmp_path / "wan_diffusers.safetensors")
    with pytest.raises(ConfigError, match=r"does not fit 'ltx2-tiny'.*transformer.blocks.0.attn1.to_q: no such "
                       r"linear layer.*Fix: use a LoRA trained for this model"):  # fmt: skip
        plane.add("wan", tmp_path / "wan_diffusers.safetensors")
    assert "wan" not in plane.entries
