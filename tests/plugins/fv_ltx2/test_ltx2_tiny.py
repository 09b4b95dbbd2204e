"""The embedded tiny LTX-2 checkpoint: published layout, consistent configs, and a real diffusers run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from fv_ltx2.tiny import TINY_ID, tiny_weights, write_tiny_checkpoint

MODEL_FOLDERS = (
    "text_encoder",
    "connectors",
    "transformer",
    "vae",
    "audio_vae",
    "vocoder",
    "latent_upsampler",
)
LAYOUT = {
    "model_index.json",
    "scheduler",
    "tokenizer",
    "ltx-2-19b-distilled-lora-384.safetensors",
    *MODEL_FOLDERS,
}
PICKLE_SUFFIXES = {".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt"}

# Smallest run the real LTX-2 geometry allows: 64x64 is 2x2 latents (a 1x1 latent breaks the VAE decoder's
# reflect padding), 9 frames is 2 latent frames (8x temporal compression, 8k + 1 frames).
HEIGHT = WIDTH = 64
NUM_FRAMES = 9
FRAME_RATE = 24.0
ALL_GUIDANCE = dict(
    guidance_scale=3.0,
    stg_scale=1.0,
    modality_scale=3.0,
    audio_guidance_scale=3.0,
    audio_stg_scale=1.0,
    audio_modality_scale=3.0,
    spatio_temporal_guidance_blocks=[1],
)


def config(folder: str | Path, name: str, file: str = "config.json") -> dict:
    return json.loads((Path(folder) / name / file).read_text())


def generate(pipe, prompt="a cat playing piano in the rain", seed=0, **kwargs):
    args = dict(
        prompt=prompt,
        negative_prompt="worst quality, blurry",
        height=HEIGHT,
        width=WIDTH,
        num_frames=NUM_FRAMES,
        frame_rate=FRAME_RATE,
        num_inference_steps=2,
        output_type="np",
        generator=torch.Generator().manual_seed(seed),
        **ALL_GUIDANCE,
    )
    return pipe(**{**args, **kwargs})


def expected_audio_samples(folder, num_frames=NUM_FRAMES, frame_rate=FRAME_RATE) -> int:
    """The pipeline's audio length: latent frames from the clip duration, 4x causal upsampling in the audio
    VAE (first latent frame -> one mel frame), then the vocoder's hop upsampling."""
    audio_vae, vocoder = config(folder, "audio_vae"), config(folder, "vocoder")
    latents_per_second = audio_vae["sample_rate"] / audio_vae["mel_hop_length"] / 4
    latent_frames = round(num_frames / frame_rate * latents_per_second)
    mel_frames = 4 * latent_frames - 3
    return mel_frames * int(np.prod(vocoder["upsample_factors"]))


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory) -> str:
    return tiny_weights(tmp_path_factory.mktemp("ltx2") / TINY_ID)


@pytest.fixture(scope="session")
def pipe(tiny_path):
    from diffusers import LTX2Pipeline

    pipe = LTX2Pipeline.from_pretrained(tiny_path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_published_layout(tiny_path):
    root = Path(tiny_path)
    assert {p.name for p in root.iterdir()} == LAYOUT
    for name in MODEL_FOLDERS:
        assert (root / name / "config.json").is_file(), name
        assert list((root / name).glob("*.safetensors")), name
    assert (root / "scheduler" / "scheduler_config.json").is_file()
    assert {p.name for p in (root / "tokenizer").iterdir()} >= {"tokenizer.json", "tokenizer_config.json"}
    files = [p for p in root.rglob("*") if p.is_file()]
    assert not [p for p in files if p.suffix in PICKLE_SUFFIXES]
    assert sum(p.stat().st_size for p in files) < 5 * 2**20

    index = json.loads((root / "model_index.json").read_text())
    assert index["_class_name"] == "LTX2Pipeline"
    classes = {name: value[1] for name, value in index.items() if not name.startswith("_") and value[0]}
    assert classes == {
        "scheduler": "FlowMatchEulerDiscreteScheduler",
        "text_encoder": "Gemma3ForConditionalGeneration",
        "tokenizer": "GemmaTokenizer",
        "connectors": "LTX2TextConnectors",
        "transformer": "LTX2VideoTransformer3DModel",
        "vae": "AutoencoderKLLTX2Video",
        "audio_vae": "AutoencoderKLLTX2Audio",
        "vocoder": "LTX2Vocoder",
    }
    assert config(root, "latent_upsampler")["_class_name"] == "LTX2LatentUpsamplerModel"


def test_configs_fit_together(tiny_path):
    text = config(tiny_path, "text_encoder")
    conn, dit = config(tiny_path, "connectors"), config(tiny_path, "transformer")
    vae, audio_vae, vocoder = (
        config(tiny_path, "vae"),
        config(tiny_path, "audio_vae"),
        config(tiny_path, "vocoder"),
    )
    upsampler = config(tiny_path, "latent_upsampler")
    scheduler = config(tiny_path, "scheduler", "scheduler_config.json")

    assert text["vision_config"]["model_type"] == "siglip_vision_model"
    hidden, layers = text["text_config"]["hidden_size"], text["text_config"]["num_hidden_layers"]
    # every hidden state (embeddings + each layer) is stacked into the connectors' input
    assert (conn["caption_channels"], conn["text_proj_in_factor"]) == (hidden, layers + 1)
    for branch in ("video", "audio"):
        width = (
            conn[f"{branch}_connector_num_attention_heads"] * conn[f"{branch}_connector_attention_head_dim"]
        )
        assert width == conn["caption_channels"] == dit["caption_channels"]
    assert dit["cross_attention_dim"] == dit["num_attention_heads"] * dit["attention_head_dim"]
    assert (
        dit["audio_cross_attention_dim"] == dit["audio_num_attention_heads"] * dit["audio_attention_head_dim"]
    )
    assert dit["rope_type"] == conn["rope_type"] == "split"

    assert dit["in_channels"] == dit["out_channels"] == vae["latent_channels"] == upsampler["in_channels"]
    assert dit["vae_scale_factors"] == [
        vae["temporal_compression_ratio"],
        vae["spatial_compression_ratio"],
        vae["spatial_compression_ratio"],
    ]
    assert (vae["spatial_compression_ratio"], vae["temporal_compression_ratio"]) == (32, 8)
    assert vae["timestep_conditioning"] is False

    packed_audio = audio_vae["latent_channels"] * audio_vae["mel_bins"] // 4
    assert dit["audio_in_channels"] == dit["audio_out_channels"] == packed_audio == audio_vae["base_channels"]
    assert vocoder["in_channels"] == audio_vae["output_channels"] * audio_vae["mel_bins"]
    assert (dit["audio_sampling_rate"], dit["audio_hop_length"]) == (16000, 160)
    assert (audio_vae["sample_rate"], audio_vae["mel_hop_length"]) == (16000, 160)
    hop_rate = audio_vae["sample_rate"] / audio_vae["mel_hop_length"]
    assert vocoder["output_sampling_rate"] == hop_rate * np.prod(vocoder["upsample_factors"]) == 24000

    assert scheduler["_class_name"] == "FlowMatchEulerDiscreteScheduler"
    assert {k: scheduler[k] for k in ("use_dynamic_shifting", "time_shift_type", "shift_terminal")} == {
        "use_dynamic_shifting": True,
        "time_shift_type": "exponential",
        "shift_terminal": 0.1,
    }
    assert (scheduler["base_image_seq_len"], scheduler["max_image_seq_len"]) == (1024, 4096)
    assert (scheduler["base_shift"], scheduler["max_shift"]) == (0.95, 2.05)


def test_tokenizer_has_gemma_conventions(tiny_path):
    from transformers import AutoTokenizer, GemmaTokenizerFast

    assert config(tiny_path, "tokenizer", "tokenizer_config.json")["padding_side"] == "left"
    tok = AutoTokenizer.from_pretrained(Path(tiny_path) / "tokenizer")
    assert isinstance(tok, GemmaTokenizerFast)
    assert (tok.pad_token, tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == ("<pad>", 0, 2, 1)
    assert tok.padding_side == "left"
    enc = tok(["a cat in the rain", "a dog"], padding="max_length", max_length=8)
    assert tok.convert_ids_to_tokens(enc.input_ids[0]) == [
        *["<pad>"] * 2,
        *["<bos>", "a", "▁cat", "▁in", "▁the", "▁rain"],
    ]
    assert enc.attention_mask[1] == [0] * 5 + [1] * 3
    assert tok.decode(tok("A Zebra, 42!").input_ids, skip_special_tokens=True) == "A Zebra, 42!"


def test_pipeline_runs_all_guidance_branches(pipe, tiny_path):
    calls = []
    hook = pipe.transformer.register_forward_hook(lambda module, args, output: calls.append(1))
    try:
        out = generate(pipe)
    finally:
        hook.remove()

    assert len(calls) == 2 * 3  # per step: batched cond/uncond, STG-perturbed, modality-isolated
    video, audio = out.frames, out.audio
    assert video.shape == (1, NUM_FRAMES, HEIGHT, WIDTH, 3)
    assert np.isfinite(video).all() and video.min() >= 0.0 and video.max() <= 1.0
    assert video.std() > 0.01
    assert audio.shape == (1, 2, expected_audio_samples(tiny_path))
    assert torch.isfinite(audio).all() and audio.abs().max() <= 1.0


def test_latent_shapes(pipe):
    out = generate(pipe, output_type="latent", height=64, width=96, num_frames=17)
    # video [B, C, (F - 1) / 8 + 1, H / 32, W / 32]; audio [B, C, round(F / fps * 25), mel_bins / 4]
    assert out.frames.shape == (1, 4, 3, 2, 3)
    assert out.audio.shape == (1, 2, 18, 2)


def test_runs_are_seeded_and_prompt_conditioned(pipe):
    a, b = generate(pipe, seed=1), generate(pipe, seed=1)
    np.testing.assert_array_equal(a.frames, b.frames)
    torch.testing.assert_close(a.audio, b.audio, rtol=0, atol=0)
    other = generate(pipe, prompt="a dog running on the beach at sunset", seed=1)
    assert np.abs(other.frames - a.frames).max() > 1e-5  # the text path reaches the video


def test_tiny_weights_is_written_once(tiny_path):
    index = Path(tiny_path) / "model_index.json"
    before = index.stat().st_mtime_ns
    assert tiny_weights(tiny_path) == tiny_path
    assert index.stat().st_mtime_ns == before
    assert [p.name for p in Path(tiny_path).parent.iterdir()] == [Path(tiny_path).name]  # no staging left


def test_transformer_override_gives_another_checkpoint(tmp_path, tiny_path):
    from diffusers import LTX2Pipeline
    from safetensors import safe_open

    rng = torch.random.get_rng_state()
    write_tiny_checkpoint(tmp_path / "deep", transformer={"num_layers": 3})
    assert torch.equal(torch.random.get_rng_state(), rng)  # the global RNG is left alone

    assert {p.name for p in (tmp_path / "deep").iterdir()} == LAYOUT
    assert config(tmp_path / "deep", "transformer")["num_layers"] == 3

    def blocks(folder):
        with safe_open(str(Path(folder) / "transformer" / "diffusion_pytorch_model.safetensors"), "pt") as f:
            return {key.split(".")[1] for key in f.keys() if key.startswith("transformer_blocks.")}

    assert (blocks(tiny_path), blocks(tmp_path / "deep")) == ({"0", "1"}, {"0", "1", "2"})
    # same seed: the components built before the transformer are byte-identical
    for name in ("text_encoder/model.safetensors", "connectors/diffusion_pytorch_model.safetensors"):
        assert (Path(tiny_path) / name).read_bytes() == (tmp_path / "deep" / name).read_bytes()

    deep = LTX2Pipeline.from_pretrained(tmp_path / "deep")
    deep.set_progress_bar_config(disable=True)
    assert len(deep.transformer.transformer_blocks) == 3
    out = generate(deep, spatio_temporal_guidance_blocks=[2])
    assert out.frames.shape == (1, NUM_FRAMES, HEIGHT, WIDTH, 3) and np.isfinite(out.frames).all()
    assert torch.isfinite(out.audio).all()
