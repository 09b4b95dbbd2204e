"""A folder shaped unlike the built-in tiny ones: a video VAE compressing time 4x (4k+1 frames), an audio
VAE at 22.05 kHz with a 256-sample mel hop and 16 mel bins (21.5 audio latents a second, not 25), three
blocks of four heads with STG attention, a non-square size. fv takes its frame and audio rules from the
folder and matches diffusers' LTX2Pipeline on it, as the other C1 tests do."""

from __future__ import annotations

import pytest
import torch
from diffusers import LTX2Pipeline
from test_ltx2_contract import REQUESTS, first_frame, reference

import fv_core
from fv_core import ConfigError
from fv_core.testing import CardContract
from fv_ltx2.tiny import write_tiny_checkpoint

RATE, HOP, MEL_BINS = 22050, 256, 16
AUDIO_FEATURES = 2 * (MEL_BINS // 4)  # audio latent channels x latent mel bins
SHAPE = dict(
    transformer=dict(
        num_layers=3, num_attention_heads=4, audio_num_attention_heads=4, perturbed_attn=True,
        vae_scale_factors=(4, 32, 32), audio_sampling_rate=RATE, audio_hop_length=HOP,
        audio_in_channels=AUDIO_FEATURES, audio_out_channels=AUDIO_FEATURES,
    ),
    # time 4x: one temporal stage less in the encoder and the decoder, still 32x in space
    vae=dict(
        downsample_type=("spatial", "temporal", "spatiotemporal", "spatial"),
        upsample_type=("spatiotemporal", "spatiotemporal", "spatial"), temporal_compression_ratio=4,
    ),
    audio_vae=dict(sample_rate=RATE, mel_hop_length=HOP, mel_bins=MEL_BINS, base_channels=AUDIO_FEATURES),
    vocoder=dict(in_channels=2 * MEL_BINS, upsample_factors=[4, 4, 4, 2, 2], upsample_kernel_sizes=[8, 8, 8, 4, 4],
                 output_sampling_rate=RATE),  # 256 samples a mel frame
)  # fmt: skip
AFFORDABLE = dict(num_frames=13, height=64, width=128, num_inference_steps=2, max_sequence_length=128)


@pytest.fixture(scope="module")
def odd_path(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("ltx2") / "ltx2-odd"
    write_tiny_checkpoint(folder, seed=13, **SHAPE)
    return str(folder)


@pytest.fixture(scope="module")
def odd_model(ltx_host, odd_path):
    return fv_core.load(odd_path, host=ltx_host)


class TestOddlyShapedFolder(CardContract):
    contract_parts = {"i2av": first_frame}
    contract_affordable = AFFORDABLE  # 13 frames: 4k+1, not 8k+1

    @pytest.fixture(scope="class")
    def contract_model(self, odd_model):
        vae, audio = (odd_model.card.components[n].config for n in ("vae", "audio_vae"))
        assert (vae["temporal_compression_ratio"], vae["spatial_compression_ratio"]) == (4, 32)
        assert (audio["sample_rate"], audio["mel_hop_length"]) == (RATE, HOP)
        return odd_model

    @pytest.fixture(scope="class")
    def contract_reference(self, odd_path):
        return reference(odd_path)

    @pytest.fixture
    def contract_requests(self):
        return [{**AFFORDABLE, **r} for r in REQUESTS[:2]] + [{**AFFORDABLE, **REQUESTS[3], "num_frames": 5}]


def test_frames_off_the_folders_grid_are_refused(odd_model, odd_path, ltx_host, ltx_path):
    """11 frames: diffusers makes 3 latent frames of it, 9 frames, not 11; fv refuses it and names 9. The
    8k+1 rule of the built-in tiny folder is not this folder's: it takes 13."""
    with pytest.raises(ConfigError, match=r"num_frames=11 must be 4k\+1 \(1, 5, 9, \.\.\.\).*Fix: use 9"):
        odd_model.prepare({"prompt": "a cat", **AFFORDABLE, "num_frames": 11})
    pipe = LTX2Pipeline.from_pretrained(odd_path)
    pipe.set_progress_bar_config(disable=True)
    latents, _ = pipe(
        "a cat", num_frames=11, height=64, width=128, num_inference_steps=2, max_sequence_length=128,
        spatio_temporal_guidance_blocks=[2], generator=torch.Generator().manual_seed(0), output_type="latent",
        return_dict=False,
    )  # fmt: skip
    assert (latents.shape[2] - 1) * 4 + 1 == 9
    tiny = fv_core.load("ltx2-tiny", ltx_path, host=ltx_host)
    with pytest.raises(ConfigError, match=r"num_frames=13 must be 8k\+1.*Fix: use 9"):
        tiny.prepare({"prompt": "a cat", "num_frames": 13})


def test_audio_length_follows_the_folders_sampling(odd_model, ltx_host, ltx_path):
    """5 frames at 240 fps last 20.8 ms, under half of this folder's audio latent (46 ms: 22050 / 256 / 4
    latents a second), so diffusers would make no audio of it: fv refuses it, naming the latent's length.
    The tiny folder's latents are 40 ms."""
    with pytest.raises(
        ConfigError, match=r"num_frames=5 at fps=240 .*too short for one audio latent \(46 ms\)"
    ):
        odd_model.prepare({"prompt": "a cat", **AFFORDABLE, "num_frames": 5, "fps": 240})
    tiny = fv_core.load("ltx2-tiny", ltx_path, host=ltx_host)
    tiny.prepare({"prompt": "a cat", "num_frames": 9, "fps": 240})  # 37.5 ms: one latent of 40 ms
