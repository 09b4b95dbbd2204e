"""C0 and C1 of the edit cards against diffusers' QwenImageEditPipeline and QwenImageEditPlusPipeline,
called as their docs call them (PIL images, one torch.Generator): the processor and the VL features,
the tiny Edit card with true CFG on and off, and an Edit Plus folder of another shape (3 blocks of 3 heads
x 8, a 24-wide text encoder) loaded by path, with two non-square images.

Each reference call encodes its image(s) at ~1024 x 1024 with the VAE (the pipelines' rule): that
encode is most of each case's time.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import edit_pipeline, picture, vl_processor

import fv_core
from fv_core.request import image_part
from fv_qwen_image.edit_params import area_size
from fv_qwen_image.vl_encoder import EDIT_TEMPLATE, VLProcessor, edit_text, vl_encode_body

WIDE = picture(60, 40, 1)  # 3:2, resized to 1248 x 832 for the VAE
TALL = picture(36, 52, 2)
SMALL = dict(height=32, width=48, num_inference_steps=2)


@pytest.fixture(scope="module")
def edit_pipe(edit_path):
    return edit_pipeline(edit_path)


def reference(pipe, images, p: dict) -> np.ndarray:
    kw = {k: v for k, v in p.items() if k != "seed"}
    return pipe(images, generator=torch.Generator().manual_seed(p["seed"]), output_type="np", **kw).images[0]


def test_c0_processor_and_vl_features(edit_model, edit_pipe, edit_path):
    """The processor's ids, patches and grid equal transformers' Qwen2VLProcessor's (Edit's and Plus's
    texts); the VL features equal the pipeline's ``encode_prompt`` of the resized image."""
    ours, theirs = (
        VLProcessor.from_pretrained(f"{edit_path}/processor"),
        vl_processor(f"{edit_path}/processor"),
    )
    for text, images in (
        (edit_text("make it blue", 1, False), [WIDE]),
        (edit_text("swap", 2, True), [WIDE, TALL]),
    ):
        got = ours(text, images)
        want = theirs(text=[text], images=images, padding=True, return_tensors="pt")
        assert all(torch.equal(got[k], want[k]) for k in ("input_ids", "pixel_values", "image_grid_thw"))
    assert text.count("Picture") == 2 and EDIT_TEMPLATE.count("<|image_pad|>") == 1
    w, h = area_size(1024 * 1024, *WIDE.size)
    resized = edit_pipe.image_processor.resize(WIDE, h, w)
    inputs = ours(edit_text("make it blue", 1, False), [resized])
    with torch.no_grad():
        embeds = vl_encode_body(edit_model.instance.component("text_encoder"), inputs)["embeds"]
        ref, mask = edit_pipe.encode_prompt("make it blue", image=resized)
    assert mask is None and torch.equal(embeds, ref)


@pytest.mark.parametrize(
    "cfg", [dict(negative_prompt=" ", true_cfg_scale=4.0), dict(true_cfg_scale=4.0)], ids=["cfg", "no-cfg"]
)
def test_c1_edit_tiny_card(edit_model, edit_pipe, cfg):
    p = dict(prompt="make it blue", seed=3, **SMALL, **cfg)
    got = edit_model.generate(image=WIDE, **p).image
    want = reference(edit_pipe, WIDE, p)
    assert got.shape == want.shape == (32, 48, 3)
    assert np.abs(got - want).max() <= edit_model.card.parity.tolerances["frames"]


def test_c1_edit_plus_folder_of_another_shape(qwen_host, plus_second_path):
    model = fv_core.load(plus_second_path, host=qwen_host)
    assert model.card.model_id == "qwen-image:qwen-edit-plus-second" and model.card.tasks == ["edit"]
    pipe = edit_pipeline(plus_second_path, plus=True)
    images = [WIDE, TALL]  # the output's default aspect is the last image's; a tall output here
    # no CFG here (two ~1024^2 images make every forward ~8k tokens); the tiny card runs CFG on and off
    p = dict(prompt="put the two together", seed=5, height=48, width=32, num_inference_steps=2)
    got = model.generate(parts=[image_part(i) for i in images], **p)
    want = reference(pipe, images, p)
    assert np.abs(got.image - want).max() <= model.card.parity.tolerances["frames"]
    assert got.provenance["metrics"]["images"] == 2


def test_c1_edit_2511_folder_reference_tokens_at_timestep_zero(qwen_host, tmp_path):
    """A Qwen-Image-Edit-2511 folder (Edit Plus layout, transformer zero_cond_t: the input image's tokens
    modulated at timestep 0) loads by path and equals diffusers' QwenImageEditPlusPipeline on it, true CFG
    on; the same weights with zero_cond_t off give another image (the flag is honoured)."""
    from fv_qwen_image.tiny import write_edit_checkpoint

    write_edit_checkpoint(
        tmp_path / "edit-2511", "QwenImageEditPlusPipeline", dict(zero_cond_t=True), seed=11
    )
    model = fv_core.load(str(tmp_path / "edit-2511"), host=qwen_host)
    assert model.instance.component("transformer").zero_cond_t
    p = dict(prompt="make it blue", negative_prompt=" ", true_cfg_scale=4.0, seed=2, **SMALL)
    got = model.generate(parts=[image_part(WIDE)], **p)
    want = reference(edit_pipeline(str(tmp_path / "edit-2511"), plus=True), [WIDE], p)
    assert np.abs(got.image - want).max() <= model.card.parity.tolerances["frames"]
    model.instance.component("transformer").zero_cond_t = False  # this test's own instance
    for block in model.instance.component("transformer").transformer_blocks:
        block.zero_cond_t = False
    assert np.abs(model.generate(parts=[image_part(WIDE)], **p).image - want).max() > 1e-3
