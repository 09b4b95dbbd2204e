"""Per-request cache statistics: steps computed vs cached, per CFG branch and in total."""

from __future__ import annotations

from typing import Any


def summarize(interceptor: str, plugin_state: dict[str, Any]) -> dict[str, Any]:
    """``result.metrics["cache_dit"]`` from a request's ``plugin_state["fv-cache-dit"]``."""
    branches = {}
    for branch, cache in plugin_state.items():
        if branch == "options" or "#" in branch:  # "#sp1", "#cfg1": other ranks' pieces of one forward
            continue
        cached = list(cache.get("cached_steps", []))
        calls = cache.get("step", -1) + 1
        branches[branch] = {"computed": calls - len(cached), "cached": len(cached), "cached_steps": cached}
    computed = sum(b["computed"] for b in branches.values())
    cached = sum(b["cached"] for b in branches.values())
    return {
        "interceptor": interceptor,
        "computed": computed,
        "cached": cached,
        "cached_fraction": cached / (computed + cached) if computed + cached else 0.0,
        "branches": branches,
        "options": plugin_state.get("options", {}),
    }
