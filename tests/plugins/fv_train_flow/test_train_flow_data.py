"""Training data and modes: the flow method's latent pool, VAE training under bf16 and decoder-only."""

import shutil

import torch
from safetensors import safe_open
from train_flow_support import TINY_VAE, flow_config

from fv_core.training import validate
from fv_train_flow import shapes
from fv_train_flow.method import FlowMethod
from fv_train_flow.vae import VaeMethod


def test_latent_pool_holds_the_streams_first_clips_and_is_reused(vae_dir, tmp_path):
    cfg = validate(flow_config(tmp_path, vae_dir, steps=1) | {"batch_size": 6})
    cfg.options["latent_pool"] = 5
    method = FlowMethod(cfg)
    latents, captions = method.clips(step=3)
    pool, pool_captions = method._pool
    assert pool.shape[0] == 5
    with safe_open(tmp_path / "latent_pool.safetensors", "pt") as f:
        assert float(f.metadata()["encode_s"]) > 0  # the encode time a cached pool hides from wall_s
    video, specs = shapes.batch(cfg.data.seed, 0, 5)
    assert torch.equal(pool, method.latents(video)) and pool_captions == [s.caption for s in specs]
    for latent, caption in zip(latents, captions, strict=True):  # every row is one pool clip
        row = next(i for i in range(5) if torch.equal(pool[i], latent))
        assert pool_captions[row] == caption
    again = FlowMethod(cfg)  # a resumed run reads the cached pool instead of encoding again
    again.latents = None  # type: ignore[assignment]  # would fail if called
    assert torch.equal(again.clips(step=3)[0], latents)


def test_latent_pool_is_encoded_again_for_a_retrained_vae(vae_dir, tmp_path):
    from diffusers import AutoencoderKLWan

    vae = tmp_path / "vae"
    shutil.copytree(vae_dir, vae)
    cfg = validate(flow_config(tmp_path / "run", vae, steps=1))
    cfg.options["latent_pool"] = 3
    before = FlowMethod(cfg).clips(step=0)[0]
    retrained = AutoencoderKLWan.from_pretrained(vae)
    with torch.no_grad():
        retrained.quant_conv.bias.add_(1.0)
    retrained.save_pretrained(vae, safe_serialization=True)
    assert not torch.equal(FlowMethod(cfg).clips(step=0)[0], before)


def test_vae_trains_under_bf16_autocast(tmp_path):
    cfg = validate({
        "method": "vae", "output_dir": str(tmp_path), "steps": 2, "batch_size": 2,
        "options": {"vae": TINY_VAE, "bf16": True, "eval_clips": 2},
    })  # fmt: skip
    method = VaeMethod(cfg)
    before = [p.detach().clone() for p in method.vae.parameters()]
    scalars = method.step(0)
    assert torch.isfinite(torch.tensor(scalars["loss"]))
    assert all(p.dtype == torch.float32 for p in method.vae.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, method.vae.parameters(), strict=True))


def test_decoder_only_finetune_keeps_the_latent_space(vae_dir, tmp_path):
    cfg = validate({
        "method": "vae", "output_dir": str(tmp_path), "steps": 1, "batch_size": 2,
        "options": {"init": str(vae_dir), "train_encoder": False, "eval_clips": 2},
    })  # fmt: skip
    method = VaeMethod(cfg)
    encoder = {k: v.clone() for k, v in method.vae.encoder.state_dict().items()}
    decoder = {k: v.clone() for k, v in method.vae.decoder.state_dict().items()}
    method.step(0)
    assert all(torch.equal(v, method.vae.encoder.state_dict()[k]) for k, v in encoder.items())
    assert any(not torch.equal(v, method.vae.decoder.state_dict()[k]) for k, v in decoder.items())
