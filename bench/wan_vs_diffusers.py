"""fv vs diffusers WanPipeline on one medium random-weight Wan checkpoint (CPU).

Usage: python bench/wan_vs_diffusers.py [--steps 4] [--rounds 2] [--threads 1] [--overhead-steps 20] [--out PATH]

Each side runs in its own subprocess, alternating for ``--rounds`` rounds;
timings are the best over rounds, which damps noise from other processes on a
shared machine. The parent writes one JSON with: single-request latency (fv
with batched CFG and a warm text-embedding cache vs diffusers), 8-concurrent
throughput (fv Engine.run_batched vs diffusers called serially), fv's runtime
overhead per step outside model calls (one request of ``--overhead-steps``
steps: the wall time between consecutive denoise bodies; beside it diffusers'
own time between transformer calls per step, the same measure on its side), and memory.

Memory, made fair: the two sides never share a process, and each side's peak
RSS is taken per scenario (the kernel's high-water mark, reset through
``/proc/self/clear_refs`` before the scenario; after loading and warming, so it
includes imports, weights and warm caches): ``single`` is one request,
``concurrent_8`` is fv's 8 batched requests against diffusers' 8 serial calls
(what each side holds while serving the same 8 requests). Every round runs
twice per side, with glibc's default allocator policy and with a fixed mmap
threshold (``MALLOC_MMAP_THRESHOLD_``, the same for both sides), since glibc's
dynamic threshold keeps freed large tensors in the heap (``allocator slack``).
fv's breakdown: imports, weights, cache bytes, the text K/V one request's
loop state holds (folded: its prompts' positions, not 512 padded ones), the scenario's growth
over the resident set (activations and step inputs), and the slack
``malloc_trim`` returns at the end. Weights are random: this measures speed only.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MEDIUM = dict(num_attention_heads=8, attention_head_dim=64, ffn_dim=2048, num_layers=8)
SIZE = dict(num_frames=9, height=64, width=64)
PROMPTS = [
    "a cat running in the forest",
    "a red car in the city at night",
    "a boat on the lake at sunset",
    "an astronaut flying over a planet",
    "a dog playing in the snow",
    "a bird flying over the ocean",
    "a horse running on the beach",
    "a robot dancing in the kitchen",
]
NEGATIVE = "blurry low quality worst quality"
REPEATS = 2


MIB = 1 << 20
MMAP_THRESHOLD = str(1 << 20)  # the fixed-threshold allocator policy (bytes)


def peak_rss_mib() -> float:
    """Peak RSS since the last :func:`reset_peak` (kernel high-water mark; else the process's peak)."""
    try:
        return rss_mib("VmHWM")
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_mib(field: str = "VmRSS") -> float:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) / 1024 for ln in f if ln.startswith(field + ":"))


def reset_peak() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    except OSError:
        pass


def trimmed_mib() -> float:
    """RSS returned by collecting garbage and ``malloc_trim`` (glibc)."""
    import ctypes
    import gc

    before = rss_mib()
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        return 0.0
    return before - rss_mib()


def best(fn, repeats: int = REPEATS) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def side_diffusers(weights: str, steps: int, overhead_steps: int = 20) -> dict:
    import torch
    from diffusers import WanPipeline

    imports = rss_mib()
    pipe = WanPipeline.from_pretrained(weights)
    pipe.set_progress_bar_config(disable=True)

    def one(i: int, steps: int = steps):
        pipe(
            PROMPTS[i],
            negative_prompt=NEGATIVE,
            num_inference_steps=steps,
            guidance_scale=5.0,
            generator=torch.Generator().manual_seed(i),
            output_type="np",
            **SIZE,
        )

    loaded = rss_mib()
    with torch.no_grad():
        one(0)  # warm-up
        reset_peak()
        single = best(lambda: one(0))
        peak_single = peak_rss_mib()
        reset_peak()
        serial8 = best(lambda: [one(i) for i in range(8)], repeats=1)
        peak_8 = peak_rss_mib()
        x = torch.randn(1, 16, (SIZE["num_frames"] - 1) // 4 + 1, SIZE["height"] // 8, SIZE["width"] // 8)
        text = torch.randn(1, 512, pipe.transformer.config.text_dim)
        call = best(lambda: pipe.transformer(x, torch.tensor([500]), text, return_dict=False), repeats=5)
        calls = []  # (start, end) of every transformer call: two per step under CFG
        pre = pipe.transformer.register_forward_pre_hook(lambda *_: calls.append([time.perf_counter()]))
        post = pipe.transformer.register_forward_hook(lambda *_: calls[-1].append(time.perf_counter()))
        one(0, overhead_steps)
        pre.remove()
        post.remove()
    # per step after the first: from the previous step's last call to this step's last call, less its calls
    per = len(calls) // overhead_steps
    steps_calls = [calls[k : k + per] for k in range(0, len(calls), per)]
    model = [sum(e - b for b, e in c) for c in steps_calls]
    gaps = [c[-1][1] - p[-1][1] - m for p, c, m in zip(steps_calls, steps_calls[1:], model[1:], strict=False)]
    params = sum(p.numel() for p in pipe.transformer.parameters())
    return dict(
        non_model_per_step_s=sum(gaps) / len(gaps),
        non_model_per_step_median_s=sorted(gaps)[len(gaps) // 2],
        model_step_s=sum(model) / len(model),
        non_model_fraction=sum(gaps) / sum(model[1:]),
        single_s=single,
        serial8_s=serial8,
        transformer_call_s=call,
        transformer_params=params,
        peak_single_mib=peak_single,
        peak_8_mib=peak_8,
        imports_mib=imports,
        loaded_mib=loaded,
        weights_mib=sum(
            t.nbytes
            for m in pipe.components.values()
            if isinstance(m, torch.nn.Module)
            for t in (*m.parameters(), *m.buffers())
        )
        / MIB,
        slack_mib=trimmed_mib(),
    )


def side_fv(weights: str, steps: int, batch_rows: int = 8, overhead_steps: int = 20) -> dict:
    import torch

    import fv_core
    from fv_core.runtime import Engine

    imports = rss_mib()  # fv's own imports; diffusers / transformers load with the components
    model = fv_core.load(weights)  # the card is built from the medium folder's own configs
    inst = model.instance

    def req(i: int, rid: str, cfg_mode: str = "batched", steps: int = steps):
        params = dict(
            prompt=PROMPTS[i],
            negative_prompt=NEGATIVE,
            num_inference_steps=steps,
            guidance_scale=5.0,
            cfg_mode=cfg_mode,
            seed=i,
            **SIZE,
        )
        return model.job(model.prepare(params, request_id=rid))

    class StepClock:
        """Observer: when each denoise body ended and how long it ran, to time what happens between bodies."""

        def __init__(self):
            self.ends, self.bodies = [], []

        def on_start(self, state, request):
            pass

        def on_finish(self, state, result):
            pass

        def on_step(self, state, plan, result):
            now = time.perf_counter()  # first: the clock's own work is not the runtime's
            if plan.kind.value == "diffusion_step":
                self.ends.append(now)
                self.bodies.append(result.seconds)

    class KVBytes(StepClock):
        """Observer: the most bytes of text keys/values a request's state held."""

        most = 0

        def on_step(self, state, plan, result):
            held = sum(t.nbytes for k, t in state.tensors.items() if k.startswith("kv"))
            self.most = max(self.most, held)

    with torch.no_grad():
        Engine().run_one(*req(0, "warm"))  # loads components, warms the text cache
        two_forward = best(lambda: Engine().run_one(*req(0, "tf", "two_forward")))
        resident_single = rss_mib()
        reset_peak()
        single = best(lambda: Engine().run_one(*req(0, "s")))
        peak_single = peak_rss_mib()
        items = lambda: [req(i, f"c{i}") for i in range(8)]  # noqa: E731
        Engine(max_batch_rows=batch_rows).run_batched(items())  # warm the 8 prompts
        resident_8 = rss_mib()
        reset_peak()
        batched8 = best(lambda: Engine(max_batch_rows=batch_rows).run_batched(items()), repeats=1)
        peak_8 = peak_rss_mib()
        clock = StepClock()
        Engine().run_one(*req(0, "ow", steps=overhead_steps))  # UniPC's terms of this schedule, cached
        Engine(observers=(clock,)).run_one(*req(0, "o", steps=overhead_steps))
        kv_state = KVBytes()
        Engine(observers=(kv_state,)).run_one(*req(0, "kv"))
    # between two denoise bodies: observers, advance (CFG combine, sampler update), next, scheduling
    gaps = [b - a - body for a, b, body in zip(clock.ends, clock.ends[1:], clock.bodies[1:], strict=False)]
    overhead, step = sum(gaps) / len(gaps), sum(clock.bodies) / len(clock.bodies)
    return dict(
        single_s=single,
        single_two_forward_s=two_forward,
        batched8_s=batched8,
        overhead_per_step_s=overhead,
        overhead_per_step_median_s=sorted(gaps)[len(gaps) // 2],
        denoise_step_s=step,
        overhead_fraction=overhead / step,
        overhead_fraction_median=sorted(gaps)[len(gaps) // 2] / step,
        peak_single_mib=peak_single,
        peak_8_mib=peak_8,
        imports_mib=imports,
        weights_mib=inst.weights_bytes() / MIB,
        **{f"cache_{k}_mib": v / MIB for k, v in inst.cache_bytes().items()},
        text_kv_state_per_request_mib=kv_state.most / MIB,
        growth_single_mib=peak_single - resident_single,
        growth_8_mib=peak_8 - resident_8,
        slack_mib=trimmed_mib(),
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per side")
    ap.add_argument("--batch-rows", type=int, default=8, help="fv Engine max_batch_rows for the 8 requests")
    ap.add_argument(
        "--overhead-steps", type=int, default=20, help="steps of the request the overhead is timed on"
    )
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "wan_vs_diffusers.json"))
    ap.add_argument("--side", choices=["fv", "diffusers"], help=argparse.SUPPRESS)
    ap.add_argument("--weights", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.side:
        import torch

        torch.set_num_threads(args.threads)
        torch.manual_seed(0)
        extra = {"batch_rows": args.batch_rows} if args.side == "fv" else {}
        fn = side_fv if args.side == "fv" else side_diffusers
        print(json.dumps(fn(args.weights, args.steps, overhead_steps=args.overhead_steps, **extra)))
        return

    from fv_wan.tiny import write_tiny_checkpoint

    allocators = {"default": {}, "mmap_threshold_1MiB": {"MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD}}
    runs: dict[tuple[str, str], list[dict]] = {(s, a): [] for a in allocators for s in ("diffusers", "fv")}
    with tempfile.TemporaryDirectory() as tmp:
        weights = Path(tmp) / "wan-medium"
        write_tiny_checkpoint(weights, transformer=MEDIUM)
        for _ in range(args.rounds):
            for side, alloc in runs:
                cmd = [sys.executable, __file__, "--side", side, "--weights", str(weights)]
                cmd += ["--steps", str(args.steps), "--threads", str(args.threads)]
                cmd += ["--batch-rows", str(args.batch_rows), "--overhead-steps", str(args.overhead_steps)]
                env = {**os.environ, **allocators[alloc]}
                done = subprocess.run(cmd, capture_output=True, text=True, env=env)
                if done.returncode:
                    sys.exit(f"{side} side failed:\n{done.stderr[-4000:]}")
                runs[side, alloc].append(json.loads(done.stdout.strip().splitlines()[-1]))
    df, fv = best_of(runs["diffusers", "default"]), best_of(runs["fv", "default"])
    result = {
        "checkpoint": {
            "transformer": MEDIUM,
            "params": df["transformer_params"],
            "weights": "random",
            "transformer_call_s": df["transformer_call_s"],
        },
        "request": {**SIZE, "steps": args.steps, "guidance": 5.0, "sampler": "unipc"},
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "torch_threads": args.threads,
            "rounds": args.rounds,
            "load_avg_1m": os.getloadavg()[0],
        },
        "single_request": {
            "diffusers_s": df["single_s"],
            "fv_s": fv["single_s"],
            "fv_two_forward_s": fv["single_two_forward_s"],
            "latency_ratio": fv["single_s"] / df["single_s"],
            "goal": "<= 0.8",
            "note": "fv: batched CFG, warm text-embedding and text K/V caches",
        },
        "concurrent_8": {
            "diffusers_serial_s": df["serial8_s"],
            "fv_batched_s": fv["batched8_s"],
            "throughput_ratio": df["serial8_s"] / fv["batched8_s"],
            "fv_max_batch_rows": args.batch_rows,
            "goal": ">= 1.3 (issue #19: >= 3)",
        },
        "runtime_overhead": {
            "per_step_s": fv["overhead_per_step_s"],
            "per_step_median_s": fv["overhead_per_step_median_s"],
            "denoise_step_s": fv["denoise_step_s"],
            "fraction_of_step": fv["overhead_fraction"],
            "fraction_of_step_median": fv["overhead_fraction_median"],
            "fraction_of_step_per_round": [r["overhead_fraction"] for r in runs["fv", "default"]],
            "steps": args.overhead_steps,
            "goal": "< 0.005 (issue #19)",
            "note": "fv wall time between consecutive denoise bodies (advance: CFG combine + sampler; next; engine); "
            "mean (and median) over one request's steps after a request of the same step count (UniPC's "
            "per-schedule terms cached), the best of rounds",
            "diffusers_non_model": {
                "per_step_s": df["non_model_per_step_s"],
                "per_step_median_s": df["non_model_per_step_median_s"],
                "model_step_s": df["model_step_s"],
                "fraction_of_step": df["non_model_fraction"],
                "fraction_of_step_per_round": [r["non_model_fraction"] for r in runs["diffusers", "default"]],
                "note": "WanPipeline wall time per step outside its two transformer calls (CFG combine, "
                "scheduler step, inputs, between the calls), by forward hooks",
            },
        },
        "peak_rss_mib": {alloc: memory(runs, alloc) for alloc in allocators},
        "memory_breakdown_mib": {
            alloc: {side: breakdown(best_of(runs[side, alloc])) for side in ("fv", "diffusers")}
            for alloc in allocators
        },
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    plot(result, Path(args.out).with_suffix(".png"))
    print(json.dumps(result, indent=2))


def memory(runs: dict, alloc: str) -> dict:
    """Per scenario: each side's peak RSS (MiB, the maximum over rounds) and fv / diffusers."""
    fv, df = best_of(runs["fv", alloc]), best_of(runs["diffusers", alloc])
    out = {}
    for scenario in ("single", "8"):
        a, b = fv[f"peak_{scenario}_mib"], df[f"peak_{scenario}_mib"]
        out["single" if scenario == "single" else "concurrent_8"] = {"fv": a, "diffusers": b, "ratio": a / b}
    return out


def breakdown(side: dict) -> dict:
    """The memory fields of one side's best-of-rounds record."""
    skip = ("peak_single_mib", "peak_8_mib")
    return {
        k.removesuffix("_mib"): round(v, 1) for k, v in side.items() if k.endswith("_mib") and k not in skip
    }


def best_of(rounds: list[dict]) -> dict:
    """Per metric: the minimum over rounds (the maximum for memory)."""
    return {k: (max if k.endswith("_mib") else min)(r[k] for r in rounds) for k in rounds[0]}


def plot(result: dict, path: Path) -> None:
    """Peak RSS bars per scenario and allocator policy, fv beside diffusers."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    labels, fv, df = [], [], []
    for alloc, scenarios in result["peak_rss_mib"].items():
        for scenario, row in scenarios.items():
            labels.append(f"{scenario}\n{alloc}")
            fv.append(row["fv"])
            df.append(row["diffusers"])
    fig, ax = plt.subplots(figsize=(8, 4))
    xs = range(len(labels))
    ax.bar([x - 0.2 for x in xs], fv, 0.4, label="fv")
    ax.bar([x + 0.2 for x in xs], df, 0.4, label="diffusers")
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_ylabel("peak RSS (MiB)")
    ax.set_title("medium Wan, CPU: peak RSS per scenario (separate processes)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
