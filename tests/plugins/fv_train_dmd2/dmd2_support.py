"""Tiny configurations shared by the fv-train-dmd2 tests."""

from __future__ import annotations

from pathlib import Path

PROMPTS = ["a red circle moving left", "a blue square moving up", "a green circle moving down"]


def dmd2_config(out: Path, prompts: Path, steps: int, **options) -> dict:
    """DMD2 on the random-weight tiny Wan (5 frames, 32x32): batch 2, a generator update every 2nd
    step, a checkpoint every 2 steps."""
    return {
        "method": "dmd2",
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
            "timesteps": [1000, 750],
            "critic_steps_per_generator": 2,
            "eval_prompts": 2,
            **options,
        },
    }
