"""The method-independent training loop: steps, progress bar, JSON-lines log, checkpoints, resume.

A method owns its modules and optimisers; the trainer owns time: when to log, evaluate,
checkpoint and stop. Checkpoints are ``<output_dir>/checkpoint-<step>/`` folders the method writes
(model weights in the real diffusers layout plus optimiser state in safetensors); the trainer adds
``trainer_state.json`` (the step, the method and the config fields the run's trajectory depends on)
and ``rng.safetensors`` (torch's global RNG, for methods that draw from it). Re-running the same
config resumes from the newest one; a checkpoint of another method or config is refused. With a
:class:`~fv_core.training.stop.StopRequest`, Ctrl-C or SIGTERM saves a checkpoint at the next step
boundary and stops.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from fv_core.errors import ConfigError
from fv_core.training.config import OptimConfig, TrainConfig, check_train_device
from fv_core.training.method import TrainMethod
from fv_core.training.stop import StopRequest, TrainingStopped

# The config fields a run's trajectory depends on: a checkpoint resumes only under the same values
# (steps, output_dir, device, threads and the logging / checkpoint cadence may change).
TRAJECTORY_FIELDS = {"seed", "batch_size", "optim", "data", "options"}


def train(
    cfg: TrainConfig, method: TrainMethod, progress: bool = True, stop: StopRequest | None = None
) -> dict[str, Any]:
    """Run ``cfg.steps`` steps (resuming if a checkpoint exists); returns a summary. When ``stop``
    catches a signal, saves a checkpoint at the next step boundary and raises :class:`TrainingStopped`.

    Logged ``time_s`` and the summary's ``wall_s`` are cumulative over resumed segments."""
    check_train_device(cfg, method.spec)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.sync is not None:
        _check_sync(cfg, method)
    start, before = _resume(cfg, method)
    t0, last = time.perf_counter(), {}
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, disable=not progress, desc="train")
    with bar, (out / "log.jsonl").open("a") as log:
        for step in bar:
            scalars = method.step(step)
            done = step + 1
            if done % cfg.log_every == 0 or done == cfg.steps:
                last = {"step": done, "time_s": round(before + time.perf_counter() - t0, 2), **scalars}
                _write(log, last)
                bar.set_postfix(loss=f"{scalars['loss']:.4f}")
            if done % cfg.eval_every == 0 or done == cfg.steps:
                _write(log, {"step": done, "eval": method.evaluate(done)})
            if cfg.sync is not None and done % cfg.sync.every == 0:
                _write(log, {"step": done, "sync": push_role(cfg, method, done)})
            stopped_by = stop.signal if stop is not None and done < cfg.steps else None
            # the last checkpoint lets a longer run resume; a stop saves where it is
            if stopped_by or done % cfg.checkpoint_every == 0 or done == cfg.steps:
                _checkpoint(cfg, method, done, before + time.perf_counter() - t0)
                plot_loss(out / "log.jsonl", out / "loss.png")
            if stopped_by:
                raise TrainingStopped(stopped_by, done, out / f"checkpoint-{done}")
    wall = before + time.perf_counter() - t0
    method.export(out / "final")
    plot_loss(out / "log.jsonl", out / "loss.png")
    summary = {
        "method": cfg.method,
        "spec": method.spec.describe(),
        "steps": cfg.steps,
        "batch_size": cfg.batch_size,
        "resumed_from": start,
        "wall_s": round(wall, 1),
        "samples_per_s": round(cfg.steps * cfg.batch_size / wall, 2) if wall > 0 else None,
        "last": last,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def push_role(cfg: TrainConfig, method: TrainMethod, step: int) -> dict[str, Any]:
    """Send ``cfg.sync.role``'s components to the server as version ``<method>-step-<step>``; returns
    the server's answer (versions, cache entries dropped, ...)."""
    from fv_core.training.sync import WeightSyncPlan, push_weights

    sync = cfg.sync
    assert sync is not None
    modules = method.roles[sync.role]
    plan = WeightSyncPlan(
        role=sync.role.value, components=sync.components, version=f"{cfg.method}-step-{step}"
    )
    api_key = os.environ.get(sync.api_key_env) if sync.api_key_env else None
    weights = {name: modules[name] for name in sync.components}
    return push_weights(sync.url, plan, weights, api_key=api_key, model=sync.model)


def _check_sync(cfg: TrainConfig, method: TrainMethod) -> None:
    """Before step 0: the sync's role and components are ones the method holds."""
    assert cfg.sync is not None
    held = {role.value: sorted(modules) for role, modules in method.roles.items()}
    missing = set(cfg.sync.components) - set(held.get(cfg.sync.role.value, []))
    if missing:
        raise ConfigError(
            f"sync.role={cfg.sync.role.value!r} with components {cfg.sync.components}: method "
            f"{cfg.method!r} holds {held}. Fix: name a role and components it holds."
        )


def _write(log, record: dict[str, Any]) -> None:
    log.write(json.dumps(record) + "\n")
    log.flush()


def checkpoints(out: str | Path) -> list[Path]:
    """The ``checkpoint-<step>`` folders of a run, oldest first."""
    return sorted(Path(out).glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))


def check_resumable(cfg: TrainConfig, checkpoint: Path) -> dict[str, Any]:
    """The checkpoint's trainer state, or a ConfigError when another method or a config with other
    :data:`TRAJECTORY_FIELDS` wrote it (continuing it would not be the run the config describes)."""
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    if state.get("method", cfg.method) != cfg.method:
        raise ConfigError(
            f"{checkpoint} was written by method {state['method']!r}; this config trains {cfg.method!r}, "
            "and a run resumes only its own checkpoints. Fix: give this config its own output_dir "
            "(or --output-dir), or resume with the config that wrote it"
        )
    saved, now = _flat(state.get("config", {})), _flat(_trajectory(cfg))
    changed = sorted(k for k in saved.keys() | now.keys() if saved.get(k) != now.get(k))
    if "config" in state and changed:  # checkpoints from before configs were recorded are not checked
        diffs = "; ".join(f"{k}={now.get(k)!r} (checkpoint: {saved.get(k)!r})" for k in changed)
        raise ConfigError(
            f"{checkpoint} belongs to another config: {diffs}. A resumed run must train as the run that "
            "wrote it. Fix: restore those values, or start fresh in a new output_dir (or --output-dir)"
        )
    return state


def _trajectory(cfg: TrainConfig) -> dict[str, Any]:
    return cfg.model_dump(mode="json", include=TRAJECTORY_FIELDS)


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"optim": {"lr": 1}}`` as ``{"optim.lr": 1}`` (so a refusal names the exact field)."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat |= _flat(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _resume(cfg: TrainConfig, method: TrainMethod) -> tuple[int, float]:
    """(step, wall seconds so far) of the newest checkpoint, loaded into ``method``; (0, 0) if none.
    Log records past that step (written after the checkpoint, before a stop) and staging folders of
    saves that never finished are dropped."""
    out = Path(cfg.output_dir)
    for staging in out.glob(".checkpoint-*"):
        shutil.rmtree(staging)
    ckpts = checkpoints(out)
    if not ckpts:
        return 0, 0.0
    state = check_resumable(cfg, ckpts[-1])
    method.load(ckpts[-1])
    torch.set_rng_state(load_file(str(ckpts[-1] / "rng.safetensors"))["torch"])
    log = out / "log.jsonl"
    if log.is_file():
        lines = [line for line in log.read_text().splitlines() if json.loads(line)["step"] <= state["step"]]
        log.write_text("".join(line + "\n" for line in lines))
    print(f"resuming from {ckpts[-1]} (step {state['step']} of {cfg.steps})", file=sys.stderr, flush=True)
    return state["step"], state["wall_s"]


def _checkpoint(cfg: TrainConfig, method: TrainMethod, step: int, wall_s: float) -> None:
    """Write ``checkpoint-<step>`` through a staging folder renamed at the end: a crash or a second
    Ctrl-C mid-save never leaves a half checkpoint. Keeps the newest ``cfg.keep_checkpoints``."""
    out = Path(cfg.output_dir)
    staging = out / f".checkpoint-{step}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        method.save(staging)
        save_file({"torch": torch.get_rng_state()}, str(staging / "rng.safetensors"))
        state = {"step": step, "wall_s": round(wall_s, 2), "method": cfg.method, "config": _trajectory(cfg)}
        (staging / "trainer_state.json").write_text(json.dumps(state))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    staging.rename(out / f"checkpoint-{step}")
    for old in checkpoints(out)[: -cfg.keep_checkpoints]:
        shutil.rmtree(old)


def plot_loss(log_path: Path, png: Path) -> None:
    """Loss (and every other logged scalar starting with ``loss``) against step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "loss" in r]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for key in sorted({k for r in rows for k in r if k.startswith("loss")}):
        pts = [(r["step"], r[key]) for r in rows if key in r]
        ax.plot(*zip(*pts, strict=True), label=key)
    ax.set_xlabel("step")
    ax.set_yscale("log")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


# ---- optimiser helpers shared by methods ----


def make_optimizer(params: list[Any], cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW over ``params``: parameters, or parameter groups (dicts) whose ``lr_scale`` multiplies the
    scheduled learning rate (:func:`set_lr`)."""
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)


def set_lr(opt: torch.optim.Optimizer, cfg: OptimConfig, step: int, total: int) -> float:
    """Linear warmup, then constant or cosine decay to ``min_lr_ratio * lr``."""
    if step < cfg.warmup_steps:
        scale = (step + 1) / cfg.warmup_steps
    elif cfg.decay == "cosine":
        frac = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
        scale = cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac))
    else:
        scale = 1.0
    for group in opt.param_groups:
        group["lr"] = cfg.lr * scale * group.get("lr_scale", 1.0)
    return cfg.lr * scale


def save_optimizer(opt: torch.optim.Optimizer, path: Path) -> None:
    """AdamW state as safetensors (no pickle): ``<param index>.<name>`` tensors."""
    tensors = {
        f"{i}.{name}": value.detach().clone() if torch.is_tensor(value) else torch.tensor(value)
        for i, state in opt.state_dict()["state"].items()
        for name, value in state.items()
    }
    save_file(tensors, str(path))


def load_optimizer(opt: torch.optim.Optimizer, path: Path) -> None:
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in load_file(str(path)).items():
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = value
    opt.load_state_dict({"state": state, "param_groups": opt.state_dict()["param_groups"]})
