"""Long clips for the shapes VAE's decoder: clips that turn and stay in view, the stationary latents of a
frozen encoder, and a decoder-only step on them."""

import pytest
import torch
from pydantic import ValidationError

from fv_core.training import validate
from fv_train_flow import shapes
from fv_train_flow.detect import detect
from fv_train_flow.vae import VaeMethod, stationary_latents


def test_long_clips_keep_the_object_in_view_and_move_one_leg_at_a_time():
    video, specs = shapes.long_batch(0, 0, 3, 33)
    assert video.shape == (3, 3, 33, 64, 64)
    for clip, spec in zip((video + 1) / 2, specs, strict=True):
        frames = clip.permute(1, 2, 3, 0)
        torch.testing.assert_close(frames[:9], shapes.render(spec))  # the first leg: the spec's own clip
        legs = [detect(frames[f : f + 9]) for f in range(0, 25, 8)]
        assert all(leg.colour == spec.colour and leg.shape == spec.shape for leg in legs)
        assert all(leg.direction is not None for leg in legs)


def test_stationary_latents_are_the_encoders_own_nine_frame_latents(vae_dir):
    from diffusers import AutoencoderKLWan

    vae = AutoencoderKLWan.from_pretrained(vae_dir).eval()
    video, _ = shapes.long_batch(1, 0, 2, 17)
    with torch.no_grad():
        z = stationary_latents(vae, video)
        assert z.shape[2] == 5
        torch.testing.assert_close(z[:, :, :3], vae.encode(video[:, :, :9]).latent_dist.mode())
        for j in (3, 4):  # the third latent frame of the 9-frame clip ending at frame 4j
            window = vae.encode(video[:, :, 4 * j - 8 : 4 * j + 1]).latent_dist.mode()
            torch.testing.assert_close(z[:, :, j], window[:, :, 2])


def test_decoder_steps_on_long_clips_leave_the_encoder_alone(vae_dir, tmp_path):
    cfg = validate({
        "method": "vae", "output_dir": str(tmp_path), "steps": 2, "batch_size": 1,
        "options": {"init": str(vae_dir), "train_encoder": False, "clip_frames": [17], "eval_clips": 2},
    })  # fmt: skip
    method = VaeMethod(cfg)
    encoder = {k: v.clone() for k, v in method.vae.encoder.state_dict().items()}
    decoder = {k: v.clone() for k, v in method.vae.decoder.state_dict().items()}
    assert torch.isfinite(torch.tensor(method.step(0)["loss"]))
    assert all(torch.equal(v, method.vae.encoder.state_dict()[k]) for k, v in encoder.items())
    assert any(not torch.equal(v, method.vae.decoder.state_dict()[k]) for k, v in decoder.items())
    assert {"last9_of_17_colour", "last9_of_17_shape", "last9_of_17_direction"} <= set(method.evaluate(1))


@pytest.mark.parametrize(
    "options,match",
    [
        ({"clip_frames": [9, 12]}, "not 4k\\+1 frames"),
        ({"clip_frames": [17]}, "train_encoder: false"),
    ],
)
def test_bad_clip_lengths_name_the_rule_and_the_fix(tmp_path, options, match):
    with pytest.raises((ValidationError, ValueError), match=match):
        VaeMethod(validate({"method": "vae", "output_dir": str(tmp_path), "steps": 1, "options": options}))
