"""A LoRA student's export in diffusers' format: the adapters alone, which served per request over the
starting checkpoint equal diffusers' ``load_lora_weights`` on the same file and the merged export the same
run writes."""

from __future__ import annotations

import json

import torch
from safetensors import safe_open
from test_nft import PROMPTS, make

import fv_core
from fv_core.training import Role

REQUEST = dict(prompt=PROMPTS[0], seed=1, guidance_scale=4.0, max_sequence_length=16, num_inference_steps=2)
# Merged (W + s B A) x and unmerged W x + s B (A x) round differently; on this random-weight card the
# frames differ by 5e-6 .. 2.5e-5 at 1 .. 3 steps (against an adapter effect of 0.015 .. 0.026). The
# trained shapes-size model of tests/plugins/fv_train_flow/test_train_flow_lora.py stays under 1e-5.
MERGED_TOL = 1e-4


def test_a_lora_students_adapters_served_per_request_equal_diffusers_and_the_merged_export(tmp_path):
    from diffusers import WanPipeline

    method = make(tmp_path, steps=1, lora_rank=2, lora_alpha=8)
    method.step(0)
    method.export(tmp_path / "exported")
    folder = tmp_path / "exported" / "lora"
    with safe_open(str(folder / "pytorch_lora_weights.safetensors"), "pt") as handle:
        keys, meta = set(handle.keys()), json.loads(handle.metadata()["lora_adapter_metadata"])
    student = method.roles[Role.STUDENT]["transformer"]
    adapted = {
        n.removesuffix(".lora_A.default.weight") for n, _ in student.named_parameters() if ".lora_A." in n
    }
    assert keys == {f"transformer.{m}.lora_{ab}.weight" for m in adapted for ab in "AB"}
    assert meta["transformer.r"] == 2 and meta["transformer.lora_alpha"] == 8

    base = fv_core.load("wan2.1-t2v-tiny")  # the run's starting checkpoint (the card's weights)
    base.instance.adapters.add("student", folder)
    served = torch.as_tensor(base.generate(**REQUEST, adapters=["student"]).frames)
    plain = torch.as_tensor(base.generate(**REQUEST).frames)
    assert (served - plain).abs().max() > 1e-3, "the adapters change the video"

    p = base.prepare(REQUEST).params
    pipe = WanPipeline.from_pretrained(base.weights)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(folder), adapter_name="student")
    with torch.no_grad():
        ref = pipe(prompt=p.prompt, negative_prompt=p.negative_prompt, num_frames=p.num_frames, height=p.height,
                   width=p.width, num_inference_steps=p.num_inference_steps, guidance_scale=p.guidance_scale,
                   max_sequence_length=p.max_sequence_length, generator=torch.Generator().manual_seed(p.seed),
                   output_type="np").frames[0]  # fmt: skip
    assert (served - torch.as_tensor(ref)).abs().max() <= 1e-5

    merged = torch.as_tensor(
        fv_core.load("wan2.1-t2v-tiny", tmp_path / "exported").generate(**REQUEST).frames
    )
    assert (served - merged).abs().max() <= MERGED_TOL
