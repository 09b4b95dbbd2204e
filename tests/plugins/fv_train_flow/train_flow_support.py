"""Tiny configurations shared by the fv-train-flow tests."""

from __future__ import annotations

from pathlib import Path

TINY_VAE = dict(
    base_dim=4,
    z_dim=16,
    dim_mult=[1, 1, 1],
    num_res_blocks=1,
    temperal_downsample=[True, True],
    patch_size=2,
    in_channels=12,
    out_channels=12,
)
TINY_DIT = dict(
    patch_size=[1, 2, 2],
    num_attention_heads=2,
    attention_head_dim=8,
    in_channels=16,
    out_channels=16,
    text_dim=16,
    freq_dim=32,
    ffn_dim=32,
    num_layers=1,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    rope_max_seq_len=64,
)
TINY_TEXT = dict(
    d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2, relative_attention_num_buckets=8, dropout_rate=0.0
)


def flow_config(out: Path, vae: Path, steps: int, **top) -> dict:
    return {
        "method": "flow",
        "output_dir": str(out),
        "steps": steps,
        "batch_size": 4,
        "log_every": 1,
        "eval_every": 1000,
        "checkpoint_every": 1000,
        "optim": {"lr": 3e-3, "warmup_steps": 0, "decay": "constant"},
        "options": {
            "vae": str(vae),
            "transformer": TINY_DIT,
            "text_encoder": TINY_TEXT,
            "ema_start": 0,
            "ema_decay": 0.5,
            "eval_clips": 8,
            "eval_samples": 0,
        },
        **top,
    }
