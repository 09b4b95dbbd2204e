"""Seconds per video of the shapes card with and without ``fv generate --cache fbcache:0.1``.

The same deployment ``--cache`` builds (``fv_core.cli.with_cache``), against the plain card, in one
process: one thread, a warm-up run each, then ``--repeats`` alternating runs; min and median of each.
Run: ``python bench/cli_cache.py`` (writes ``bench/results/cli_cache.json``).
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import fv_core
from fv_core.cli import with_cache
from fv_core.plugins import load_plugins

CARD, PROMPT = "wan2.1-t2v-shapes", "a red circle moving left"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "cli_cache.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    host = load_plugins()
    deploy = with_cache(host, None, CARD, None, "fbcache", 0.1)
    models = {
        "plain": fv_core.load(CARD, host=host),
        "fbcache:0.1": fv_core.load(CARD, deploy=deploy, host=host),
    }
    seconds: dict[str, list[float]] = {name: [] for name in models}
    for run in range(args.repeats + 1):
        for name, model in models.items():
            start = time.perf_counter()
            video = model.generate(prompt=PROMPT, seed=1)
            if run:  # run 0 is the warm-up
                seconds[name].append(time.perf_counter() - start)
    stats = video.provenance["metrics"]["cache_dit"]
    result = {
        "card": CARD,
        "threads": 1,
        "seconds": {
            name: {"min": min(s), "median": statistics.median(s), "runs": [round(x, 4) for x in s]}
            for name, s in seconds.items()
        },
        "ratio_min": min(seconds["fbcache:0.1"]) / min(seconds["plain"]),
        "ratio_median": statistics.median(seconds["fbcache:0.1"]) / statistics.median(seconds["plain"]),
        "cached_calls": stats["cached"],
        "transformer_calls": stats["cached"] + stats["computed"],
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
