"""Seconds per video of the shapes card with and without ``--cache fbcache:0.1`` (the README's numbers).

One thread, one model loaded each way, a warm-up run each, then 3 alternating runs: the min of 3.
Run: ``python examples/cache_timing.py``.
"""

import time

import torch

import fv_core
from fv_core.cli import with_cache
from fv_core.plugins import load_plugins

CARD, PROMPT = "wan2.1-t2v-shapes", "a red circle moving left"

torch.set_num_threads(1)
host = load_plugins()
models = {
    "plain": fv_core.load(CARD, host=host),
    "fbcache:0.1": fv_core.load(CARD, deploy=with_cache(host, None, CARD, None, "fbcache", 0.1), host=host),
}
seconds: dict[str, list[float]] = {name: [] for name in models}
for run in range(4):
    for name, model in models.items():
        start = time.perf_counter()
        video = model.generate(prompt=PROMPT, seed=1)
        if run:  # run 0 is the warm-up
            seconds[name].append(time.perf_counter() - start)
stats = video.provenance["metrics"]["cache_dit"]
for name, runs in seconds.items():
    print(f"{name}: min {min(runs):.3f} s  runs {[round(s, 3) for s in runs]}")
print(f"fbcache:0.1 cached {stats['cached']} of {stats['cached'] + stats['computed']} transformer calls")
