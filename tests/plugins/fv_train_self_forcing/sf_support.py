"""Tiny configurations shared by the fv-train-self-forcing tests."""

from __future__ import annotations

from pathlib import Path

PROMPTS = ["a red circle moving left", "a blue square moving up", "a green circle moving down"]


def sf_config(out: Path, prompts: Path, steps: int, **options) -> dict:
    """Self-forcing on the random-weight tiny Wan (9 frames = 3 latent frames of 32x32, one per chunk, the
    tiny causal card's schedule): batch 2, a generator update every 2nd step, a checkpoint every 2 steps."""
    return {
        "method": "self_forcing",
        "output_dir": str(out),
        "steps": steps,
        "batch_size": 2,
        "log_every": 1,
        "eval_every": 1000,
        "checkpoint_every": 2,
        "optim": {"lr": 1e-3, "warmup_steps": 0, "decay": "constant"},
        "options": {
            "teacher": "wan2.1-t2v-tiny",
            "prompts": str(prompts),
            "num_frames": 9,
            "flow_shift": 5.0,
            "window_frames": 3,
            "sink_frames": 1,
            "critic_steps_per_generator": 2,
            "ema_decay": 0.5,
            "eval_prompts": 2,
            **options,
        },
    }
