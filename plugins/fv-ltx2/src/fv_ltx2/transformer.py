"""LTX-2's transformer driven block by block, so a block interceptor (fv-cache-dit) can reach inside.

``forward_blocks`` runs the same submodules in the same order as diffusers'
``LTX2VideoTransformer3DModel.forward`` (positions, input projections, timestep and cross-attention
modulation, caption projections, the blocks, the output layers), with the block loop handed to
``fv_core.extend.drive_blocks``. Both streams go through the seam as one tensor per row: the video
and the audio hidden states flattened and concatenated, so a cached span carries both. The loop uses
it only when a block hook is attached; otherwise the model's own forward runs.
"""

from __future__ import annotations

from typing import Any

import torch

from fv_core import ConfigError
from fv_core.extend import BlockHook, drive_blocks


def _text_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return ((1 - mask.to(dtype)) * -10000.0).unsqueeze(1)


def _modulation(embedder, t: torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor:
    value, _ = embedder(t, batch_size=rows, hidden_dtype=dtype)
    return value.view(rows, -1, value.shape[-1])


def forward_blocks(m, hook: BlockHook | None, branch: str, inputs: dict[str, Any], statics: dict[str, Any]):
    """(video velocity, audio velocity) of one call, its blocks driven through ``hook``."""
    if m.config.use_keyframes_abs_pos_embedding or (m.prompt_modulation and m.config.use_prompt_adaln_single):
        raise ConfigError(
            "block interceptors drive LTX-2.0 transformers; this checkpoint uses LTX-2.3+ prompt modulation or "
            "keyframe embeddings. Fix: disable the block interceptor for this model."
        )
    video, audio = inputs["latents"], inputs["audio_latents"]
    timestep, rows, dtype = (
        inputs["timestep"],
        video.shape[0],
        video.dtype,
    )  # per video token when conditioned
    audio_timestep = inputs.get("audio_timestep", timestep)  # also the sigma of both modalities
    text_bias = _text_bias(inputs["text_mask"], video.dtype)
    video_coords, audio_coords = inputs["video_coords"], inputs["audio_coords"]
    rope = dict(
        video_rotary_emb=m.rope(video_coords, device=video.device),
        audio_rotary_emb=m.audio_rope(audio_coords, device=audio.device),
        ca_video_rotary_emb=m.cross_attn_rope(video_coords[:, 0:1, :], device=video.device),
        ca_audio_rotary_emb=m.cross_attn_audio_rope(audio_coords[:, 0:1, :], device=audio.device),
    )
    video, audio = m.proj_in(video), m.audio_proj_in(audio)
    gate_factor = m.config.cross_attn_timestep_scale_multiplier / m.config.timestep_scale_multiplier
    temb, video_embedded = m.time_embed(timestep.flatten(), batch_size=rows, hidden_dtype=dtype)
    temb_audio, audio_embedded = m.audio_time_embed(
        audio_timestep.flatten(), batch_size=rows, hidden_dtype=dtype
    )
    sigma = audio_timestep.flatten()
    video_ca = sigma if statics["use_cross_timestep"] else timestep.flatten()
    audio_ca = sigma
    text, audio_text = inputs["video_text"], inputs["audio_text"]
    if m.config.use_prompt_embeddings:
        text = m.caption_projection(text).view(rows, -1, video.size(-1))
        audio_text = m.audio_caption_projection(audio_text).view(rows, -1, audio.size(-1))
    kwargs = dict(
        encoder_hidden_states=text,
        audio_encoder_hidden_states=audio_text,
        temb=temb.view(rows, -1, temb.size(-1)),
        temb_audio=temb_audio.view(rows, -1, temb_audio.size(-1)),
        temb_ca_scale_shift=_modulation(m.av_cross_attn_video_scale_shift, video_ca, rows, dtype),
        temb_ca_audio_scale_shift=_modulation(m.av_cross_attn_audio_scale_shift, audio_ca, rows, dtype),
        temb_ca_gate=_modulation(m.av_cross_attn_video_a2v_gate, video_ca * gate_factor, rows, dtype),
        temb_ca_audio_gate=_modulation(m.av_cross_attn_audio_v2a_gate, audio_ca * gate_factor, rows, dtype),
        temb_prompt=None,
        temb_prompt_audio=None,
        encoder_attention_mask=text_bias,
        audio_encoder_attention_mask=text_bias,
        self_attention_mask=None,
        audio_self_attention_mask=None,
        a2v_cross_attention_mask=None,
        v2a_cross_attention_mask=None,
        use_a2v_cross_attention=not statics["isolate_modalities"],
        use_v2a_cross_attention=not statics["isolate_modalities"],
        **rope,
    )
    stg = set(statics["spatio_temporal_guidance_blocks"] or [])
    perturb = torch.zeros((rows,))[:, None, None] if stg else None
    video_shape, audio_shape = video.shape, audio.shape

    def block(index: int, hidden: torch.Tensor) -> torch.Tensor:
        v, a = hidden.split([video_shape[1] * video_shape[2], audio_shape[1] * audio_shape[2]], dim=1)
        v, a = m.transformer_blocks[index](
            hidden_states=v.view(video_shape),
            audio_hidden_states=a.view(audio_shape),
            perturbation_mask=perturb if index in stg else None,
            all_perturbed=bool(index in stg),
            **kwargs,
        )
        return torch.cat([v.flatten(1), a.flatten(1)], dim=1)

    hidden = drive_blocks(
        hook, branch, torch.cat([video.flatten(1), audio.flatten(1)], dim=1), len(m.transformer_blocks), block
    )
    v, a = hidden.split([video_shape[1] * video_shape[2], audio_shape[1] * audio_shape[2]], dim=1)
    return _out(m.norm_out, m.proj_out, m.scale_shift_table, video_embedded, v.view(video_shape), rows), _out(
        m.audio_norm_out,
        m.audio_proj_out,
        m.audio_scale_shift_table,
        audio_embedded,
        a.view(audio_shape),
        rows,
    )


def _out(
    norm, proj, table: torch.Tensor, embedded: torch.Tensor, hidden: torch.Tensor, rows: int
) -> torch.Tensor:
    shift_scale = table[None, None] + embedded.view(rows, -1, embedded.size(-1))[:, :, None]
    return proj(norm(hidden) * (1 + shift_scale[:, :, 1]) + shift_scale[:, :, 0])
