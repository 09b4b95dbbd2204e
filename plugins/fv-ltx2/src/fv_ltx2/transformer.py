"""LTX-2's transformer driven block by block, so a block interceptor (fv-cache-dit) can reach inside.

``forward_blocks`` runs the same submodules in the same order as diffusers'
``LTX2VideoTransformer3DModel.forward`` (positions, input projections, timestep and cross-attention
modulation, caption projections, the blocks, the output layers), with the block loop handed to
``fv_core.extend.drive_blocks``. Both streams go through the seam as one tensor per row: the video
and the audio hidden states flattened and concatenated, so a cached span carries both. The loop uses
it when a block hook is attached or the step runs on a parallel group; otherwise the model's own
forward runs.

Under sequence parallelism (``fv_core.parallel``) each rank takes its shard of the video tokens and of
the audio tokens, with their coordinates (RoPE on global positions) and any per-token timestep; the
attentions that span a whole stream swap to head shards (:mod:`fv_ltx2.attention`), and both outputs
are gathered after their output projections. Outside a group ``shard`` and ``gather`` are identities.
"""

from __future__ import annotations

from typing import Any

import torch

from fv_core import ConfigError
from fv_core.extend import BlockHook, BlockHooks, drive_blocks
from fv_core.parallel import gather, shard
from fv_ltx2.attention import stream_tokens


def _text_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return ((1 - mask.to(dtype)) * -10000.0).unsqueeze(1)


def _modulation(embedder, t: torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor:
    value, _ = embedder(t, batch_size=rows, hidden_dtype=dtype)
    return value.view(rows, -1, value.shape[-1])


def unsupported(config: Any) -> str | None:
    """Why fv cannot drive a transformer with this config block by block (None: it can)."""
    modulation = config.get("cross_attn_mod") or config.get("audio_cross_attn_mod")
    if config.get("use_keyframes_abs_pos_embedding") or (
        modulation and config.get("use_prompt_adaln_single", True)
    ):
        return "it uses LTX-2.3+ timestep-driven prompt modulation or keyframe embeddings"
    return None


def forward_blocks(
    m, hook: BlockHook | BlockHooks | None, branch: str, inputs: dict[str, Any], statics: dict[str, Any]
):
    """(video velocity, audio velocity) of one call, its blocks driven through ``hook``."""
    why = unsupported(m.config)
    if why is not None:
        raise ConfigError(
            f"fv drives LTX-2.0 transformers block by block (block interceptors, parallel groups); this "
            f"checkpoint cannot be: {why}. Fix: disable the block interceptor and the parallel plan."
        )
    video, audio = inputs["latents"], inputs["audio_latents"]
    video_tokens, audio_tokens, rows, dtype = video.shape[1], audio.shape[1], video.shape[0], video.dtype
    timestep = inputs["timestep"]  # [rows], or [rows, video tokens] when conditioned
    audio_timestep = inputs.get("audio_timestep", timestep)  # also the sigma of both modalities
    if timestep.ndim == 2:  # per video token: this rank's tokens
        timestep = shard(timestep, 1)
    text_bias = _text_bias(inputs["text_mask"], video.dtype)
    video_coords, audio_coords = inputs["video_coords"], inputs["audio_coords"]
    rope = dict(  # the tables of all positions, then this rank's rows of them (a shard may be empty)
        video_rotary_emb=_shard_rope(m.rope(video_coords, device=video.device)),
        audio_rotary_emb=_shard_rope(m.audio_rope(audio_coords, device=audio.device)),
        ca_video_rotary_emb=_shard_rope(m.cross_attn_rope(video_coords[:, 0:1, :], device=video.device)),
        ca_audio_rotary_emb=_shard_rope(
            m.cross_attn_audio_rope(audio_coords[:, 0:1, :], device=audio.device)
        ),
    )
    video, audio = shard(video, 1), shard(audio, 1)
    video, audio = m.proj_in(video), m.audio_proj_in(audio)
    gate_factor = m.config.cross_attn_timestep_scale_multiplier / m.config.timestep_scale_multiplier
    temb, video_embedded = m.time_embed(timestep.flatten(), batch_size=rows, hidden_dtype=dtype)
    temb_audio, audio_embedded = m.audio_time_embed(
        audio_timestep.flatten(), batch_size=rows, hidden_dtype=dtype
    )
    sigma = audio_timestep.flatten()
    video_ca = sigma if statics["use_cross_timestep"] else timestep.flatten()
    audio_ca = sigma
    prompt_kv = "video_kv" in inputs  # every block's prompt keys/values, computed once per request
    if prompt_kv:
        text, audio_text = inputs["video_kv"], inputs["audio_kv"]  # [rows, blocks, 2, text tokens, dim]
    else:
        text, audio_text = inputs["video_text"], inputs["audio_text"]
    if m.config.use_prompt_embeddings and not prompt_kv:
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

    picked: dict[tuple[int, ...], dict[str, Any]] = {}  # per-row inputs of the row subsets a hook runs

    def block(index: int, hidden: torch.Tensor, subset: torch.Tensor | None = None) -> torch.Tensor:
        mine = dict(kwargs, perturbation_mask=perturb)
        if subset is not None:
            mine = picked.setdefault(tuple(subset.tolist()), pick_rows(mine, subset, rows))
        if prompt_kv:  # this block's keys/values (fv_ltx2.prompt_kv.PromptKVAttention takes them)
            video_kv, audio_kv = mine["encoder_hidden_states"], mine["audio_encoder_hidden_states"]
            mine = dict(
                mine, encoder_hidden_states=video_kv[:, index], audio_encoder_hidden_states=audio_kv[:, index]
            )
        n = hidden.shape[0]
        v, a = hidden.split([video_shape[1] * video_shape[2], audio_shape[1] * audio_shape[2]], dim=1)
        v, a = m.transformer_blocks[index](
            hidden_states=v.view(n, *video_shape[1:]),
            audio_hidden_states=a.view(n, *audio_shape[1:]),
            all_perturbed=bool(index in stg),
            **{**mine, "perturbation_mask": mine["perturbation_mask"] if index in stg else None},
        )
        return torch.cat([v.flatten(1), a.flatten(1)], dim=1)

    with stream_tokens(video_tokens, audio_tokens):
        hidden = torch.cat([video.flatten(1), audio.flatten(1)], dim=1)
        hidden = drive_blocks(hook, branch, hidden, len(m.transformer_blocks), block)
    v, a = hidden.split([video_shape[1] * video_shape[2], audio_shape[1] * audio_shape[2]], dim=1)
    v = _out(m.norm_out, m.proj_out, m.scale_shift_table, video_embedded, v.view(video_shape), rows)
    a = _out(
        m.audio_norm_out,
        m.audio_proj_out,
        m.audio_scale_shift_table,
        audio_embedded,
        a.view(audio_shape),
        rows,
    )
    return gather(v, 1, video_tokens), gather(a, 1, audio_tokens)


def pick_rows(kwargs: dict[str, Any], subset: torch.Tensor, rows: int) -> dict[str, Any]:
    """The batch rows ``subset`` of every per-row block input (tensors, and tuples of them, whose first
    dim is the call's ``rows``); inputs shared by every row stay as they are."""

    def pick(value: Any) -> Any:
        if isinstance(value, tuple):
            return tuple(pick(v) for v in value)
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == rows:
            return value.index_select(0, subset.to(value.device))
        return value

    return {name: pick(value) for name, value in kwargs.items()}


def _shard_rope(table: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's tokens of a (cos, sin) RoPE table: [B, heads, tokens, r] ("split") or [B, tokens, dim]."""
    dim = 2 if table[0].ndim == 4 else 1
    return shard(table[0], dim), shard(table[1], dim)


def _out(
    norm, proj, table: torch.Tensor, embedded: torch.Tensor, hidden: torch.Tensor, rows: int
) -> torch.Tensor:
    shift_scale = table[None, None] + embedded.view(rows, -1, embedded.size(-1))[:, :, None]
    return proj(norm(hidden) * (1 + shift_scale[:, :, 1]) + shift_scale[:, :, 0])
