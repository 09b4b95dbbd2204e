"""Where training clips come from: the flow method's latent pool and the VAE method's path crops."""

import torch
from train_flow_support import TINY_VAE, flow_config

from fv_train_flow import shapes
from fv_train_flow.config import validate
from fv_train_flow.detect import detect
from fv_train_flow.method import FlowMethod
from fv_train_flow.vae import VaeMethod, path_crops


def test_latent_pool_holds_the_streams_first_clips_and_is_reused(vae_dir, tmp_path):
    cfg = validate(flow_config(tmp_path, vae_dir, steps=1) | {"batch_size": 6})
    cfg.options["latent_pool"] = 5
    method = FlowMethod(cfg)
    latents, captions = method.clips(step=3)
    pool, pool_captions = method._pool
    assert pool.shape[0] == 5 and (tmp_path / "latent_pool.safetensors").is_file()
    video, specs = shapes.batch(cfg.data.seed, 0, 5)
    assert torch.equal(pool, method.latents(video)) and pool_captions == [s.caption for s in specs]
    for latent, caption in zip(latents, captions, strict=True):  # every row is one pool clip
        row = next(i for i in range(5) if torch.equal(pool[i], latent))
        assert pool_captions[row] == caption
    again = FlowMethod(cfg)  # a resumed run reads the cached pool instead of encoding again
    again.latents = None  # type: ignore[assignment]  # would fail if called
    assert torch.equal(again.clips(step=3)[0], latents)


def test_path_crops_keep_the_object_and_the_latent_grid():
    video, specs = shapes.batch(seed=4, index=0, size=16)
    crops = path_crops(video, specs, 48)
    assert crops.shape == (16, 3, shapes.FRAMES, 48, 48)
    for clip, crop, spec in zip(video, crops, specs, strict=True):
        frames = (crop.permute(1, 2, 3, 0) + 1) / 2
        found = detect(frames)  # colour and motion survive the crop (the object may leave it at the ends)
        assert (found.colour, found.direction) == (spec.colour, spec.direction)
        offsets = [
            (y, x)
            for y in range(17)
            for x in range(17)
            if torch.equal(clip[..., y : y + 48, x : x + 48], crop)
        ]
        assert offsets and all(y % 8 == 0 and x % 8 == 0 for y, x in offsets)


def test_vae_trains_on_crops_under_bf16_autocast(tmp_path):
    cfg = validate({
        "method": "vae", "output_dir": str(tmp_path), "steps": 2, "batch_size": 2,
        "options": {"vae": TINY_VAE, "crop": 32, "bf16": True, "eval_clips": 2},
    })  # fmt: skip
    method = VaeMethod(cfg)
    before = [p.detach().clone() for p in method.vae.parameters()]
    scalars = method.step(0)
    assert torch.isfinite(torch.tensor(scalars["loss"]))
    assert all(p.dtype == torch.float32 for p in method.vae.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, method.vae.parameters(), strict=True))
