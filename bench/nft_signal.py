"""Signal or noise: does a DiffusionNFT step on the shapes model follow its reward further than its own
noise moves it?

Runs fv-train-nft (real rollouts through the serve loop, the method's own step) from the same parent,
seeds and optimiser with four rewards driving the advantages:

- ``reward``: the shapes-detector reward of configs/shapes/nft.yaml (soft shape margin);
- ``negated``: minus that reward (the same signal, the other way);
- ``random``: uniform noise per video (no signal: what the update alone does to the model);
- ``brightness``: the frames' mean brightness (a reward any video model can follow);
- ``lora:reward``, ``lora:random``: the first and third with a LoRA student (``--lora-rank``, at
  ``--lora-lr``): the published way to train the policy, which confines each step to a few directions.

Each arm is configs/shapes/nft.yaml on one caption with shared_noise and 2 noise levels per sample.
Every arm records the shapes-detector reward of each step's rollouts (whatever drove them), the
driving reward and the KL to the parent, then evaluates the final student on the caption (30 UniPC
steps, ``--eval-seeds`` seeds: shape accuracy, median fill, start distance from the centre). Writes
bench/results/nft_signal.json and .png.

    python bench/nft_signal.py                 # "a green square moving left", 8 groups of 8, 20 steps
    python bench/nft_signal.py --smoke         # 2 groups of 2, 2 steps: the script end to end
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml

import fv_core
from fv_core.training import validate
from fv_train_flow import shapes
from fv_train_flow.detect import detect
from fv_train_flow.eval import by_caption, generate_videos
from fv_train_nft.method import NftMethod

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs/shapes/nft.yaml"
ARMS = ("reward", "negated", "random", "brightness", "lora:reward", "lora:random")


class DrivingReward:
    """The reward an arm's advantages come from; every call records the shapes reward's mean."""

    def __init__(self, arm: str, shapes_reward: Any, seed: int) -> None:
        self.arm, self.shapes_reward = arm, shapes_reward
        self.noise = torch.Generator().manual_seed(seed)
        self.seen: list[float] = []

    def __call__(self, frames: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        score = self.shapes_reward(frames, prompts).float()
        self.seen.append(score.mean().item())
        if self.arm == "negated":
            return -score
        if self.arm == "random":
            return torch.rand(len(score), generator=self.noise)
        if self.arm == "brightness":
            return frames.float().mean(dim=(1, 2, 3, 4))
        return score


def config(args: argparse.Namespace, out: Path, lora: bool) -> dict[str, Any]:
    cfg = yaml.safe_load(CONFIG.read_text())
    if lora:
        cfg["optim"]["lr"] = args.lora_lr
        cfg["options"]["lora_rank"] = args.lora_rank
    cfg.update(output_dir=str(out), steps=args.steps, seed=args.seed, eval_every=10**6, threads=args.threads)
    options = cfg["options"]
    options.pop("prompts_file")
    options.update(
        prompts=[args.caption],
        prompts_per_step=args.groups,
        group_size=args.group_size,
        rollout_steps=args.rollout_steps,
        train_timesteps=2,
        shared_noise=True,
        eval_seeds=0,
    )
    return cfg


def evaluate(model: Any, caption: str, seeds: int, steps: int) -> dict[str, Any]:
    _, colour, shape, _, direction = caption.split()
    pairs = [(shapes.ClipSpec(colour, shape, direction, (0.0, 0.0)), s) for s in range(seeds)]
    videos, _ = generate_videos(model, pairs, steps, 1.0, "unipc")
    return by_caption(pairs, [detect(v) for v in videos])[caption]


def run_arm(arm: str, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        student, _, reward = arm.rpartition(":")
        method = NftMethod(validate(config(args, Path(tmp) / "run", student == "lora")))
        method.reward = DrivingReward(reward, method.reward, args.seed)
        curve, start = [], time.perf_counter()
        for step in range(args.steps):
            log = method.step(step)
            curve.append({"step": step + 1, "shapes_reward": round(method.reward.seen[-1], 4),
                          "driving_reward": round(log["reward"], 4), "kl": round(log["loss_kl"], 5)})  # fmt: skip
        seconds = time.perf_counter() - start
        method.export(Path(tmp) / "student")
        student = fv_core.load(args.card, Path(tmp) / "student")
        final = evaluate(student, args.caption, args.eval_seeds, args.eval_steps)
    last = curve[-min(5, len(curve)) :]
    return {
        "curve": curve,
        "rollout_shapes_reward_first": curve[0]["shapes_reward"],
        "rollout_shapes_reward_max": max(c["shapes_reward"] for c in curve),
        "rollout_shapes_reward_last5": round(sum(c["shapes_reward"] for c in last) / len(last), 4),
        "kl_last": curve[-1]["kl"],
        "final_eval": final,
        "seconds_per_step": round(seconds / args.steps, 2),
    }


def summary(report: dict[str, Any]) -> dict[str, Any]:
    """Per student (full, lora): the last rollouts' shapes reward, real reward minus random reward
    (the signal) and random reward minus the start (what noise alone does), and every eval."""
    arms = report["arms"]
    out: dict[str, Any] = {"eval_shape": {"parent": report["parent_eval"]["shape"]}}
    out["eval_shape"] |= {arm: res["final_eval"]["shape"] for arm, res in arms.items()}
    for prefix in ("", "lora:"):
        real, noise = arms.get(f"{prefix}reward"), arms.get(f"{prefix}random")
        if real and noise:
            out[prefix.rstrip(":") or "full"] = {
                "rollout_reward_gain_vs_random": round(
                    real["rollout_shapes_reward_last5"] - noise["rollout_shapes_reward_last5"], 4
                ),
                "rollout_reward_change_under_random": round(
                    noise["rollout_shapes_reward_last5"] - noise["rollout_shapes_reward_first"], 4
                ),
                "kl_random": noise["kl_last"],
                "kl_reward": real["kl_last"],
            }
    return out


def plot(report: dict[str, Any], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    for arm, res in report["arms"].items():
        steps = [c["step"] for c in res["curve"]]
        ax1.plot(steps, [c["shapes_reward"] for c in res["curve"]], "-o", ms=3, label=arm)
        ax2.plot(steps, [c["kl"] for c in res["curve"]], "-o", ms=3, label=arm)
    start = next(iter(report["arms"].values()))["rollout_shapes_reward_first"]  # every arm's first rollouts
    ax1.axhline(start, color="grey", lw=0.8, ls="--")
    ax1.set_title(f"shapes reward of the rollouts, '{report['settings']['caption']}'", fontsize=9)
    ax2.set_title("KL to the parent (velocity MSE)", fontsize=9)
    for ax in (ax1, ax2):
        ax.set_xlabel("NFT step (rollouts of the policy before it)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--caption", default="a green square moving left")
    ap.add_argument("--card", default="wan2.1-t2v-shapes")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--rollout-steps", type=int, default=10)
    ap.add_argument("--eval-seeds", type=int, default=48)
    ap.add_argument("--eval-steps", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--lora-rank", type=int, default=4)
    ap.add_argument("--lora-lr", type=float, default=3e-4)
    ap.add_argument("--smoke", action="store_true", help="2 groups of 2, 2 steps, 4 eval seeds")
    ap.add_argument("--out", help="default bench/results/nft_signal.json; --smoke: the temp dir")
    args = ap.parse_args()
    if args.smoke:
        args.steps, args.groups, args.group_size, args.rollout_steps = 2, 2, 2, 2
        args.eval_seeds, args.eval_steps = 4, 4
    torch.set_num_threads(args.threads)
    parent = fv_core.load(args.card)
    report: dict[str, Any] = {
        "settings": {k: v for k, v in vars(args).items() if k != "out"}
        | {"config": str(CONFIG.relative_to(REPO))},
        "parent_eval": evaluate(parent, args.caption, args.eval_seeds, args.eval_steps),
        "arms": {},
    }
    for arm in args.arms.split(","):
        report["arms"][arm] = run_arm(arm, args)
        res = report["arms"][arm]
        print(f"{arm}: rollout shapes reward {res['rollout_shapes_reward_first']} -> "
              f"{res['rollout_shapes_reward_last5']} (max {res['rollout_shapes_reward_max']}), "
              f"KL {res['kl_last']}, eval shape {res['final_eval']['shape']}", flush=True)  # fmt: skip
    report["signal_over_noise"] = summary(report)
    out = Path(
        args.out
        or (Path(tempfile.gettempdir()) if args.smoke else REPO / "bench/results") / "nft_signal.json"
    )
    out.write_text(json.dumps(report, indent=1) + "\n")
    plot(report, out.with_suffix(".png"))
    print(json.dumps(report["signal_over_noise"], indent=1))


if __name__ == "__main__":
    main()
