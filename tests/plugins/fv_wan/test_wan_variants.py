"""Wan2.1 I2V, Wan2.2 TI2V-5B and Wan2.2 A14B (T2V, I2V) on the one Wan loop.

C1: fv's frames equal diffusers' pipeline (``WanImageToVideoPipeline``, ``WanPipeline`` with
``transformer_2`` / ``expand_timesteps``) on the same tiny folder, image, prompt, seed and
settings within 1e-5, for two differently shaped checkpoints of every variant; the folders are
loaded by path alone. Then the interleave gate across variants, expert-pure batches, and the
image input rules.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

import fv_core
from fv_core import ConfigError
from fv_core.parity import assert_interleave_parity
from fv_core.request import ImagePart
from fv_core.runtime import Engine

TOLERANCE = 1e-5
IMAGE = np.random.default_rng(7).random((40, 56, 3)).astype(np.float32)  # not the video's aspect
PROMPT, NEGATIVE = "a red cat running in the forest", "blurry low quality"
# one request, as both sides take it (plus size, seed and each case's settings)
SETTINGS = dict(
    prompt=PROMPT, negative_prompt=NEGATIVE, num_frames=5, num_inference_steps=4, guidance_scale=3.0
)
SMALL = dict(num_frames=5, height=32, width=48, max_sequence_length=512)  # folder-built cards default to 480p

# variant -> (diffusers pipeline, fv task, whether an image goes in, size, extra settings)
CASES = {
    "i2v": ("WanImageToVideoPipeline", "i2v", True, (32, 48), {}),
    "ti2v": ("WanPipeline", "t2v", False, (64, 96), {}),
    "ti2v-image": ("WanImageToVideoPipeline", "i2v", True, (64, 96), {}),
    "t2v-a14b": ("WanPipeline", "t2v", False, (32, 48), {"guidance_scale_2": 2.0}),
    "i2v-a14b": ("WanImageToVideoPipeline", "i2v", True, (32, 48), {"guidance_scale_2": 2.0}),
}


def folder_variant(case: str) -> str:
    return case.removesuffix("-image")


def diffusers_frames(folder: str, pipeline: str, image: bool, size, settings: dict) -> np.ndarray:
    import diffusers

    pipe = getattr(diffusers, pipeline).from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    height, width = size
    kwargs = dict(image=Image.fromarray(ImagePart(IMAGE).pixels())) if image else {}
    out = pipe(
        **SETTINGS,
        height=height,
        width=width,
        generator=torch.Generator().manual_seed(5),
        output_type="np",
        **kwargs,
        **settings,
    )
    return out.frames[0]


@pytest.mark.parametrize("shape", ["first", "second"])
@pytest.mark.parametrize("case", list(CASES))
def test_c1_frames_match_diffusers(case, shape, variant_folders, wan_host):
    pipeline, task, image, size, settings = CASES[case]
    folder = variant_folders[folder_variant(case), shape]
    model = fv_core.load(weights=folder, host=wan_host)  # by path alone: variant and tasks from the folder
    height, width = size
    with torch.no_grad():
        ours = model.generate(
            task=task,
            parts=[ImagePart(IMAGE)] if image else [],
            **SETTINGS,
            height=height,
            width=width,
            max_sequence_length=512,
            seed=5,
            **settings,
        ).frames
        ref = diffusers_frames(folder, pipeline, image, size, settings)
    assert ours.shape == ref.shape
    assert np.abs(ours - ref).max() <= TOLERANCE


def test_each_variant_is_read_from_its_folder(variant_folders, wan_host):
    tasks = {
        variant: fv_core.load(weights=variant_folders[variant, "first"], host=wan_host).card.tasks
        for variant in ("i2v", "ti2v", "t2v-a14b", "i2v-a14b")
    }
    assert tasks == {
        "i2v": ["i2v"],
        "ti2v": ["t2v", "t2i", "i2v"],
        "t2v-a14b": ["t2v", "t2i"],
        "i2v-a14b": ["i2v"],
    }


def test_a14b_switches_experts_at_the_boundary(variant_folders, wan_host):
    model = fv_core.load(weights=variant_folders["t2v-a14b", "first"], host=wan_host)
    art = model.generate(task="t2i", **{**SMALL, "prompt": PROMPT, "seed": 1, "num_inference_steps": 6})
    # UniPC at flow shift 3, 6 steps: timesteps 999, 937, 857, 750, 600, 375; the boundary is 875
    assert art.provenance["metrics"]["experts"] == ["transformer"] * 2 + ["transformer_2"] * 4


def _items(models):
    """Requests of every variant, interleaved on one engine: different sizes, steps, guidance."""
    i2v, ti2v, t2v_a14b, i2v_a14b = models
    image = [ImagePart(IMAGE)]
    specs = [
        (i2v, "a", dict(task="i2v", parts=image, num_inference_steps=3)),
        (ti2v, "b", dict(task="i2v", parts=image, height=64, width=96, num_inference_steps=2)),
        (ti2v, "c", dict(task="t2v", height=64, width=64, num_inference_steps=3, prompt="a blue boat")),
        (t2v_a14b, "d", dict(task="t2v", num_inference_steps=5, guidance_scale_2=2.0)),
        (t2v_a14b, "e", dict(task="t2v", num_inference_steps=3, prompt="a dog", cfg_mode="batched")),
        (i2v_a14b, "f", dict(task="i2v", parts=image, num_inference_steps=4)),
    ]

    def make():
        out = []
        for model, rid, spec in specs:
            spec = dict(spec)
            task, parts = spec.pop("task"), spec.pop("parts", [])
            raw = {
                **SMALL,
                "prompt": PROMPT,
                "negative_prompt": NEGATIVE,
                "seed": ord(rid),
                "guidance_scale": 3.0,
                **spec,
            }
            request = model.prepare(raw, task=task, parts=parts, request_id=rid)
            out.append((model.runnable(task), request, model.instance))
        return out

    return make


@pytest.fixture(scope="module")
def variant_models(variant_folders, wan_host):
    return [
        fv_core.load(weights=variant_folders[v, "first"], host=wan_host)
        for v in ("i2v", "ti2v", "t2v-a14b", "i2v-a14b")
    ]


def test_interleave_gate_across_variants(variant_models):
    report = assert_interleave_parity(Engine, _items(variant_models))
    assert report.ok and report.max_abs == 0.0


def test_batched_a14b_requests_never_mix_experts(variant_models, monkeypatch):
    """Two A14B requests whose step 2 falls on different experts (6 steps: 937 high-noise; 3 steps: 857
    low-noise): batched where their experts agree, never across experts."""
    from fv_core.runtime import oom, scheduler

    model, batches = variant_models[2], []
    batched, alone = oom.run_batch, scheduler.run_plan  # batched calls run in oom (with the split)

    def seen(plans):
        if plans[0].label.startswith("denoise"):
            batches.append([(p.label, p.batch_key.instance) for p in plans])

    def spy_batched(plans, profile, *mode):
        seen(plans)
        return batched(plans, profile, *mode)

    def spy_alone(plan, profile):  # the scheduler runs a lone plan without the batcher
        seen([plan])
        return alone(plan, profile)

    monkeypatch.setattr(oom, "run_batch", spy_batched)
    monkeypatch.setattr(scheduler, "run_plan", spy_alone)

    def item(rid, steps):
        raw = {
            "prompt": PROMPT,
            "seed": 3,
            "num_inference_steps": steps,
            "guidance_scale": 1.0,
            **SMALL,
            "num_frames": 1,
        }
        return model.runnable("t2i"), model.prepare(raw, task="t2i", request_id=rid), model.instance

    with torch.no_grad():
        results = Engine().run_batched([item("x", 6), item("y", 3)])
    for batch in batches:  # one expert per call, and it is the expert every plan in it asked for
        # a batch key's instance: "<instance id>/<expert>@<pinned version>" (fv_core.loop.batch_key)
        experts = {instance.rsplit("/", 1)[1].split("@")[0] for _, instance in batch}
        assert len(experts) == 1
        assert all(("transformer_2" in label) == (experts == {"transformer_2"}) for label, _ in batch)
    assert any(len(batch) == 2 for batch in batches), "the two requests were never batched"
    step_two = [b for b in batches if any(label.startswith("denoise 2/") for label, _ in b)]
    assert [len(b) for b in step_two] == [1, 1]  # different experts: two calls
    assert (
        results[0].metrics["experts"][1] == "transformer"
        and results[1].metrics["experts"][1] == "transformer_2"
    )


def test_image_rules(variant_models):
    i2v, ti2v = variant_models[0], variant_models[1]
    with pytest.raises(ConfigError, match="exactly one image") as err:
        i2v.generate(task="i2v", prompt=PROMPT, seed=1)
    assert "--image" in str(err.value)
    with pytest.raises(ConfigError, match="multiple of 32"):
        ti2v.prepare({"prompt": PROMPT, "height": 48, "width": 64}, task="t2v")
    with pytest.raises(ConfigError, match="guidance_scale_2"):
        i2v.prepare({"prompt": PROMPT, "guidance_scale_2": 2.0}, task="i2v", parts=[ImagePart(IMAGE)])
