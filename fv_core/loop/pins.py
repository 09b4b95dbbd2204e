"""Pinning a request to weight versions, and the batch key built from the pins: one meaning everywhere.

A request runs to its end on the weights that were live when it started. Its first loop pins every
component's version (``state.values["weights_versions"]``: component -> version) and, where the
request carries adapters, every adapter's (``state.values["adapter_versions"]``: adapter -> version).
A program's later stages take the pins their first stage handed on in ``request.carry``. Plans whose
pins differ never share a batched call: a batch key's ``instance`` names the model instance and the
pinned versions of exactly the components (and adapters) the plan runs.
"""

from __future__ import annotations

from typing import Any

import torch

from fv_core.loop.contracts import BatchKey, LoopState

WEIGHTS = "weights_versions"  # state.values / request.carry / result.metrics key: component -> version
ADAPTERS = "adapter_versions"  # the same for the request's adapters: adapter name -> version


def pin_versions(request: Any, instance: Any) -> dict[str, dict[str, str]]:
    """The versions ``request`` runs on to the end: those an earlier program stage pinned (it made what
    this stage is handed), else the instance's live ones."""
    carry = getattr(request, "carry", {}) or {}
    pins = {WEIGHTS: dict(carry.get(WEIGHTS) or getattr(instance, WEIGHTS, {}))}
    if carry.get(ADAPTERS):
        pins[ADAPTERS] = dict(carry[ADAPTERS])
    return pins


def pinned_state(
    request: Any,
    instance: Any,
    loop_id: str,
    *,
    total_steps: int | None = None,
    seed: int | None = None,
) -> LoopState:
    """A new LoopState pinned to ``request``'s versions, with a CPU generator seeded by ``seed`` (the
    request's params' seed when None; diffusers draws its noise on the CPU too)."""
    seed = getattr(request.params, "seed", request.seed) if seed is None else seed
    state = LoopState(
        request.request_id,
        loop_id,
        total_steps=total_steps,
        generator=torch.Generator(device="cpu").manual_seed(int(seed)),
    )
    state.values.update(pin_versions(request, instance))
    return state


def pinned(state: LoopState, component: str) -> str | None:
    """The version of ``component`` the request pinned (None: a component without versions, e.g. a
    tokenizer; it runs on the live one)."""
    return state.values.get(WEIGHTS, {}).get(component)


def pinned_module(instance: Any, state: LoopState, component: str) -> Any:
    """``component`` on the weights the request pinned (a weight sync since leaves it on them)."""
    return instance.component(component, pinned(state, component))


def weights_on(instance: Any, state: LoopState, *components: str) -> str:
    """A batch key's ``instance``: the model instance, the pinned versions of ``components`` and the
    request's adapter versions. Plans on other versions never share a call."""
    versions = "+".join(f"{c}@{pinned(state, c) or 'live'}" for c in components)
    adapters = state.values.get(ADAPTERS)
    lora = "|" + ",".join(f"{a}@{v}" for a, v in sorted(adapters.items())) if adapters else ""
    return f"{instance.instance_id}/{versions}{lora}"


def batch_key(
    instance: Any,
    state: LoopState,
    components: str | tuple[str, ...],
    kind: str,
    shape_sig: tuple,
    precision: str,
    *,
    parallel_plan: str = "single",
    graph_key: str = "",
) -> BatchKey:
    """The batch key of a plan of ``kind`` that runs ``components`` on the request's pinned versions."""
    names = (components,) if isinstance(components, str) else components
    return BatchKey(weights_on(instance, state, *names), kind, shape_sig, precision, parallel_plan, graph_key)
