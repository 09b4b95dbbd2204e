"""Pinning a request to weight versions, and the batch key built from the pins: one meaning everywhere.

A request runs to its end on the weights that were live when it started. Its first loop pins every
component's version (``state.values["weights_versions"]``: component -> version) and, where the
request carries adapters, every adapter's (``state.values["adapter_versions"]``: adapter -> version).
A program's later stages take the pins their first stage handed on in ``request.carry``. Plans whose
pins differ never share a batched call: a batch key's ``instance`` names the model instance and the
pinned versions of exactly the components the plan runs. Adapters are applied per row
(``fv_core.adapters``), so they split cache keys (``adapter_tag``), never batch keys.
"""

from __future__ import annotations

from typing import Any

import torch

from fv_core.loop.contracts import BatchKey, LoopState

WEIGHTS = "weights_versions"  # state.values / request.carry / result.metrics key: component -> version
ADAPTERS = "adapter_versions"  # the same for the request's adapters: adapter name -> version


ADAPTER_USES = "adapters"  # state.values key: the request's adapters, [name, version, scale, components]


def pin_versions(request: Any, instance: Any) -> dict[str, Any]:
    """The versions ``request`` runs on to the end: those an earlier program stage pinned (it made what
    this stage is handed), else the instance's live ones; and the adapters it names, at the versions it
    was admitted with."""
    carry = getattr(request, "carry", {}) or {}
    pins: dict[str, Any] = {WEIGHTS: dict(carry.get(WEIGHTS) or getattr(instance, WEIGHTS, {}))}
    uses = tuple(getattr(request, "adapters", ()))
    if uses:
        pins[ADAPTERS] = {u.name: u.version for u in uses}
        pins[ADAPTER_USES] = [[u.name, u.version, u.scale, list(u.components)] for u in uses]
    return pins


def hold_adapters(request: Any, instance: Any, state: LoopState) -> None:
    """Hold ``request``'s adapters on the instance's adapter plane until it leaves (hooks installed on the
    module versions it pinned)."""
    uses = tuple(getattr(request, "adapters", ()))
    if uses:
        instance.adapters.hold(request.request_id, uses, state.values[WEIGHTS])


def adapter_tag(state: LoopState, component: str) -> str:
    """What a cache key of ``component``'s output must add for the request's adapters on it
    (``""`` without any): their names, versions and scales, in order."""
    uses = [u for u in state.values.get(ADAPTER_USES, ()) if component in u[3]]
    return ",".join(f"{name}@{version}*{scale!r}" for name, version, scale, _ in uses)


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
    hold_adapters(request, instance, state)
    return state


def pinned(state: LoopState, component: str) -> str | None:
    """The version of ``component`` the request pinned (None: a component without versions, e.g. a
    tokenizer; it runs on the live one)."""
    return state.values.get(WEIGHTS, {}).get(component)


def pinned_module(instance: Any, state: LoopState, component: str) -> Any:
    """``component`` on the weights the request pinned (a weight sync since leaves it on them)."""
    return instance.component(component, pinned(state, component))


def weights_on(instance: Any, state: LoopState, *components: str) -> str:
    """A batch key's ``instance``: the model instance and the pinned versions of ``components``. Plans on
    other versions never share a call; plans with other adapters do (each row gets its own, unmerged)."""
    versions = "+".join(f"{c}@{pinned(state, c) or 'live'}" for c in components)
    return f"{instance.instance_id}/{versions}"


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
