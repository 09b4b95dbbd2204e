"""The embedded ``ltx2-tiny`` checkpoint: LTX-2's real architecture at tiny size with RANDOM weights
from a fixed seed, written once in the published diffusers layout of ``Lightricks/LTX-2``
(``scheduler/ text_encoder/ tokenizer/ connectors/ transformer/ vae/ audio_vae/ vocoder/
latent_upsampler/`` and ``model_index.json``, safetensors only), so it loads through
``diffusers.LTX2Pipeline.from_pretrained`` like the real checkpoint.

Its weights are random: it produces noise-like video and audio. It exists for tests, demos and
benchmarks, not for generation quality.

What is kept from the real checkpoint (so shape arithmetic matches it):

* video VAE compression 32x spatial / 8x temporal (``patch_size=4`` plus three 2x stages), so the
  frame count is ``8k + 1`` and height/width multiples of 32, latent ``[B, 4, (F-1)/8+1, H/32, W/32]``;
* audio at 16 kHz with a 160-sample mel hop, audio VAE compression 4x in time and in mel bins,
  vocoder upsampling 240x to 24 kHz stereo;
* the text path: Gemma3 (with a SigLIP vision tower) -> all ``num_layers + 1`` hidden states
  stacked -> ``LTX2TextConnectors`` (128 learnable registers, split RoPE) -> the transformer's
  caption projections; ``rope_type="split"`` everywhere;
* the scheduler config (FlowMatch Euler, dynamic exponential shifting 0.95..2.05 over 1024..4096
  tokens, terminal shift 0.1).

Dimensions that must agree: text hidden 32 x (2 layers + 1) = 96 features into the connectors, whose
width 32 (2 heads x 16) is the transformer's ``caption_channels``; transformer audio ``in_channels``
4 = audio latent channels 2 x latent mel bins (8 / 4); audio VAE ``base_channels`` 4 = that same
product (its latent statistics are per packed feature); vocoder ``in_channels`` 16 = 2 output
channels x 8 mel bins; the video transformer and the audio branch have the same number of heads (2),
which split RoPE in the audio-video cross-attention needs.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from fv_core.weights import cache_dir, materialize
from fv_ltx2.cards import CLASSES, REFINE_LORA

TINY_ID = "ltx2-tiny"
TINY_VERSION = "v2"  # bump when the configs, vocabulary or seed below change

SEED = 20250102

# FlowMatchEulerDiscreteScheduler arguments LTX-2 (non-distilled) ships; the rest are class defaults
# (time_shift_type "exponential", num_train_timesteps 1000, shift 1.0).
LTX2_SCHEDULER = dict(
    use_dynamic_shifting=True,
    base_shift=0.95,
    max_shift=2.05,
    base_image_seq_len=1024,
    max_image_seq_len=4096,
    shift_terminal=0.1,
    time_shift_type="exponential",
)

# Gemma3 text tower: 2 layers, hidden 32, 2 query heads / 1 KV head of 16.
TINY_TEXT = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    query_pre_attn_scalar=16,
    layer_types=["sliding_attention", "full_attention"],
    sliding_window=512,
    max_position_embeddings=4096,
)
# SigLIP vision tower of Gemma3ForConditionalGeneration: 16x16 images in 4x4 patches.
TINY_VISION = dict(
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    image_size=16,
    patch_size=4,
    vision_use_head=False,
)
TINY_MM_TOKENS_PER_IMAGE = 4  # (16 / 4) patches per side pooled 2x2

TEXT_LAYERS = TINY_TEXT["num_hidden_layers"]
TEXT_HIDDEN = TINY_TEXT["hidden_size"]

TINY_CONNECTORS = dict(
    caption_channels=TEXT_HIDDEN,
    text_proj_in_factor=TEXT_LAYERS + 1,  # embeddings + every layer's hidden state
    video_connector_num_attention_heads=2,
    video_connector_attention_head_dim=TEXT_HIDDEN // 2,
    video_connector_num_layers=2,
    video_connector_num_learnable_registers=128,
    video_gated_attn=False,
    audio_connector_num_attention_heads=2,
    audio_connector_attention_head_dim=TEXT_HIDDEN // 2,
    audio_connector_num_layers=2,
    audio_connector_num_learnable_registers=128,
    audio_gated_attn=False,
    connector_rope_base_seq_len=4096,
    rope_theta=10000.0,
    rope_double_precision=True,
    causal_temporal_positioning=False,
    rope_type="split",
    per_modality_projections=False,
    proj_bias=False,
)

VIDEO_LATENT_CHANNELS = 4
AUDIO_LATENT_CHANNELS = 2
MEL_BINS = 8
AUDIO_DOWNSAMPLE = 4  # fixed in diffusers' AutoencoderKLLTX2Audio (time and mel)
AUDIO_FEATURES = AUDIO_LATENT_CHANNELS * (MEL_BINS // AUDIO_DOWNSAMPLE)  # packed audio token width: 4
SAMPLE_RATE = 16000
HOP_LENGTH = 160

TINY_TRANSFORMER = dict(
    in_channels=VIDEO_LATENT_CHANNELS,
    out_channels=VIDEO_LATENT_CHANNELS,
    patch_size=1,
    patch_size_t=1,
    num_attention_heads=2,
    attention_head_dim=8,
    cross_attention_dim=16,  # = video inner dim (caption projection output)
    vae_scale_factors=(8, 32, 32),
    pos_embed_max_pos=20,
    base_height=2048,
    base_width=2048,
    gated_attn=False,
    cross_attn_mod=False,
    audio_in_channels=AUDIO_FEATURES,
    audio_out_channels=AUDIO_FEATURES,
    audio_patch_size=1,
    audio_patch_size_t=1,
    audio_num_attention_heads=2,
    audio_attention_head_dim=4,
    audio_cross_attention_dim=8,  # = audio inner dim
    audio_scale_factor=AUDIO_DOWNSAMPLE,
    audio_pos_embed_max_pos=20,
    audio_sampling_rate=SAMPLE_RATE,
    audio_hop_length=HOP_LENGTH,
    audio_gated_attn=False,
    audio_cross_attn_mod=False,
    num_layers=2,
    activation_fn="gelu-approximate",
    qk_norm="rms_norm_across_heads",
    norm_elementwise_affine=False,
    norm_eps=1e-6,
    caption_channels=TEXT_HIDDEN,  # = connector width
    attention_bias=True,
    attention_out_bias=True,
    rope_theta=10000.0,
    rope_double_precision=True,
    causal_offset=1,
    timestep_scale_multiplier=1000,
    cross_attn_timestep_scale_multiplier=1000,
    rope_type="split",
    use_prompt_embeddings=True,
    perturbed_attn=False,
)

# Same block structure and compression as LTX-2's video VAE (4 encoder stages, 3 decoder stages,
# patch 4 -> 32x spatial, 8x temporal), one resnet per stage and 4..32 channels.
TINY_VAE = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=VIDEO_LATENT_CHANNELS,
    block_out_channels=(8, 8, 16, 16),
    down_block_types=("LTX2VideoDownBlock3D",) * 4,
    decoder_block_out_channels=(8, 16, 32),  # smallest: the residual upsampler needs >= 8 channels in
    layers_per_block=(1, 1, 1, 1, 1),
    decoder_layers_per_block=(1, 1, 1, 1),
    spatio_temporal_scaling=(True, True, True, True),
    decoder_spatio_temporal_scaling=(True, True, True),
    decoder_inject_noise=(False, False, False, False),
    downsample_type=("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
    upsample_type=("spatiotemporal", "spatiotemporal", "spatiotemporal"),
    upsample_residual=(True, True, True),
    upsample_factor=(2, 2, 2),
    timestep_conditioning=False,
    patch_size=4,
    patch_size_t=1,
    resnet_norm_eps=1e-6,
    encoder_causal=True,
    decoder_causal=False,
    encoder_spatial_padding_mode="zeros",
    decoder_spatial_padding_mode="reflect",
    spatial_compression_ratio=32,
    temporal_compression_ratio=8,
)

TINY_AUDIO_VAE = dict(
    base_channels=AUDIO_FEATURES,  # its latents_mean/std are per packed feature (channels x mel bins)
    output_channels=2,
    ch_mult=(1, 2, 4),
    num_res_blocks=1,
    attn_resolutions=None,
    in_channels=2,
    resolution=256,
    latent_channels=AUDIO_LATENT_CHANNELS,
    norm_type="pixel",
    causality_axis="height",
    dropout=0.0,
    mid_block_add_attention=False,
    sample_rate=SAMPLE_RATE,
    mel_hop_length=HOP_LENGTH,
    is_causal=True,
    mel_bins=MEL_BINS,
    double_z=True,
)

TINY_VOCODER = dict(
    in_channels=2 * MEL_BINS,  # stereo mel spectrogram, channels x mel bins
    hidden_channels=32,
    out_channels=2,
    upsample_kernel_sizes=[16, 15, 8, 4, 4],
    upsample_factors=[6, 5, 2, 2, 2],  # 240 = 24000 / (16000 / 160)
    resnet_kernel_sizes=[3, 7, 11],
    resnet_dilations=[[1, 3, 5], [1, 3, 5], [1, 3, 5]],
    act_fn="leaky_relu",
    leaky_relu_negative_slope=0.1,
    antialias=False,
    final_act_fn="tanh",
    final_bias=True,
    output_sampling_rate=24000,
)

TINY_LATENT_UPSAMPLER = dict(
    in_channels=VIDEO_LATENT_CHANNELS,
    mid_channels=32,  # GroupNorm(32, .) needs a multiple of 32
    num_blocks_per_stage=1,
    dims=3,
    spatial_upsample=True,
    temporal_upsample=False,
    rational_spatial_scale=2.0,
    use_rational_resampler=True,
)

# Gemma's special tokens at Gemma's low ids, then Gemma3's turn and image markers.
_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>")
_MARKERS = ("<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>", "<image_soft_token>")
_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789,.'-!?:;"
# A small closed vocabulary of whole words; anything else falls back to characters and bytes.
_WORDS = (
    "a an the of in on at with and or to from by over under near into through while as is are "
    "cat dog bird fish horse person man woman child girl boy robot car boat train plane tree flower "
    "forest mountain river lake ocean sea beach city street road house kitchen room window door stage "
    "sky cloud sun moon star rain snow fire water light shadow night day morning evening sunset "
    "red orange yellow green blue purple black white gray golden silver bright dark warm cold "
    "big small tall old young happy sad slow fast quiet loud soft hard long short "
    "running walking flying swimming jumping dancing sitting standing eating playing talking singing "
    "speaks says sings laughs whispers shouts music song voice sound noise drum guitar piano "
    "wind waves birds chirping footsteps engine crowd applause silence "
    "camera video film scene shot view close wide slowly pans zooms tracking "
    "cinematic realistic detailed blurry static low quality worst overexposed ugly distorted jittery "
    "inconsistent motion smiles looks hair face eyes hands wearing jacket dress hat"
).split()


def tiny_vocab() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Gemma-style BPE vocabulary and merges in which every word of ``_WORDS`` after a space is one token.

    Ids: ``<pad>``=0, ``<eos>``=1, ``<bos>``=2, ``<unk>``=3, ``<mask>``=4 (Gemma's), then the turn and
    image markers, the 256 ``<0xNN>`` byte-fallback tokens, ``▁`` and single characters, then ``▁word``
    tokens, each grown from ``▁`` one character at a time (so no two words' merges compete). Gemma adds
    no dummy prefix, so a prompt's first word, having no ``▁``, is spelled in characters; characters
    outside ``_CHARS`` (capitals, accents) fall back to bytes, never ``<unk>``.
    """
    vocab: dict[str, int] = {}
    for token in (*_SPECIALS, *_MARKERS, *(f"<0x{b:02X}>" for b in range(256)), "▁", *_CHARS):
        vocab.setdefault(token, len(vocab))
    merges: list[tuple[str, str]] = []
    for word in _WORDS:
        token = "▁"
        for char in word:
            merged = token + char
            if merged not in vocab:
                vocab[merged] = len(vocab)
                merges.append((token, char))
            token = merged
    return vocab, merges


def tiny_weights(path: str | os.PathLike | None = None) -> str:
    """Materialize the tiny checkpoint (once) and return its folder.

    :param path: target folder; default ``<cache>/weights/ltx2-tiny/<TINY_VERSION>``.
    """
    target = Path(path) if path is not None else cache_dir() / "weights" / TINY_ID / TINY_VERSION
    return materialize(target, write_tiny_checkpoint)


def tiny_config() -> dict[str, dict]:
    """What the ``ltx2-tiny`` card requires of its folder: the published classes and the tiny sizes."""
    sizes = {
        "transformer": {k: TINY_TRANSFORMER[k] for k in ("num_layers", "num_attention_heads", "in_channels")},
        "vae": {"latent_channels": VIDEO_LATENT_CHANNELS},
        "audio_vae": {"latent_channels": AUDIO_LATENT_CHANNELS, "mel_bins": MEL_BINS},
    }
    return {name: {**CLASSES.get(name, {}), **sizes.get(name, {})} for name in CLASSES}


def transformer_config(overrides: dict | None = None) -> dict:
    """The tiny transformer config with ``overrides``; cross-attention widths follow the head sizes
    unless overridden (they must equal the video and audio inner dims)."""
    overrides = dict(overrides or {})
    config = {**TINY_TRANSFORMER, **overrides}
    if "cross_attention_dim" not in overrides:
        config["cross_attention_dim"] = config["num_attention_heads"] * config["attention_head_dim"]
    if "audio_cross_attention_dim" not in overrides:
        config["audio_cross_attention_dim"] = (
            config["audio_num_attention_heads"] * config["audio_attention_head_dim"]
        )
    return config


def write_tiny_checkpoint(
    folder: Path,
    transformer: dict | None = None,
    seed: int = SEED,
    *,
    vae: dict | None = None,
    audio_vae: dict | None = None,
    vocoder: dict | None = None,
) -> None:
    """Write the full diffusers layout into ``folder`` (random weights from ``seed``).

    :param transformer: overrides of the transformer config (e.g. ``{"num_layers": 3}`` for a
        second, differently-shaped checkpoint).
    :param vae: overrides of the video VAE config (e.g. another temporal compression); ``audio_vae``
        and ``vocoder`` likewise (another sample rate or mel hop). The transformer's matching values
        (``vae_scale_factors``, ``audio_in_channels``, ...) are the caller's to override with them.
        Text and connector sizes are fixed.
    """
    from diffusers import (
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        FlowMatchEulerDiscreteScheduler,
        LTX2Pipeline,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2 import LTX2LatentUpsamplerModel, LTX2TextConnectors, LTX2Vocoder
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3TextConfig,
        SiglipVisionConfig,
    )

    folder = Path(folder)
    tokenizer = gemma_tokenizer()
    vocab = tokenizer.get_vocab()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_config = Gemma3TextConfig(
            vocab_size=len(vocab),
            pad_token_id=vocab["<pad>"],
            eos_token_id=vocab["<eos>"],
            bos_token_id=vocab["<bos>"],
            **TINY_TEXT,
        )
        config = Gemma3Config(
            text_config=text_config,
            vision_config=SiglipVisionConfig(**TINY_VISION),
            mm_tokens_per_image=TINY_MM_TOKENS_PER_IMAGE,
            boi_token_index=vocab["<start_of_image>"],
            eoi_token_index=vocab["<end_of_image>"],
            image_token_index=vocab["<image_soft_token>"],
        )
        text_encoder = Gemma3ForConditionalGeneration(config).eval()
        connectors = LTX2TextConnectors(**TINY_CONNECTORS)
        dit = LTX2VideoTransformer3DModel(**transformer_config(transformer))
        video_vae = AutoencoderKLLTX2Video(**{**TINY_VAE, **(vae or {})})
        audio = AutoencoderKLLTX2Audio(**{**TINY_AUDIO_VAE, **(audio_vae or {})})
        voc = LTX2Vocoder(**{**TINY_VOCODER, **(vocoder or {})})
        latent_upsampler = LTX2LatentUpsamplerModel(**TINY_LATENT_UPSAMPLER)
        lora = distilled_lora(dit)
    pipe = LTX2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**LTX2_SCHEDULER),
        vae=video_vae,
        audio_vae=audio,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        connectors=connectors,
        transformer=dit,
        vocoder=voc,
    )
    pipe.save_pretrained(folder, safe_serialization=True)
    # Not a pipeline component: LTX-2 ships it for the two-stage (upsample + refine) workflow.
    latent_upsampler.save_pretrained(folder / "latent_upsampler", safe_serialization=True)
    save_file(lora, folder / REFINE_LORA)  # at the top level, where Lightricks/LTX-2 ships its refine LoRA


def distilled_lora(dit, rank: int = 4) -> dict:
    """A random rank-``rank`` LoRA on every attention projection, keyed as LTX-2's own LoRA files are
    (``diffusion_model.<module>.lora_A/B.weight``); it stands in for the distilled refine LoRA."""
    lora = {}
    for name, module in dit.named_modules():
        if name.endswith((".to_q", ".to_k", ".to_v", ".to_out.0")) and ".transformer_blocks." in f".{name}":
            lora[f"diffusion_model.{name}.lora_A.weight"] = torch.randn(rank, module.in_features) * 0.02
            lora[f"diffusion_model.{name}.lora_B.weight"] = torch.randn(module.out_features, rank) * 0.02
    return lora


def gemma_tokenizer():
    """A ``GemmaTokenizer`` (the tokenizers-backed "fast" one) over :func:`tiny_vocab`, built offline.

    Gemma's conventions: BPE with byte fallback, spaces as ``▁``, ``<bos>`` prepended, ``<pad>``=0,
    left padding (the pipeline also sets it), no lowercasing (capitals go through byte fallback).
    """
    from transformers import GemmaTokenizerFast

    vocab, merges = tiny_vocab()
    return GemmaTokenizerFast(
        vocab=vocab,
        merges=merges,
        add_bos_token=True,
        add_eos_token=False,
        padding_side="left",
        model_max_length=1024,
        extra_special_tokens=list(_MARKERS),
    )
