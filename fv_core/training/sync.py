"""Hot weight sync: a trainer pushes new weights into a model while it serves.

A :class:`WeightSyncPlan` names what a payload replaces: the trainer's role whose weights these
are, the components (``transformer``, ``text_encoder``, ...) and the new ``weights_version``. The
payload is the components' tensors (all of a ``state_dict()``, or only those that changed), keyed
``"<component>.<tensor name>"`` (one safetensors file over HTTP)::

    plan = WeightSyncPlan(role="student", components=["transformer"], version="step-100")
    push_weights("http://127.0.0.1:8000", plan, student.transformer, api_key=KEY)  # to `fv serve`
    sync_weights(model, plan, student.transformer)                 # in process, nothing running
    sync_weights(model, plan, student.transformer, engine=engine)  # at a running engine's next step boundary

A sync runs in two halves. ``stage_sync`` checks every tensor against the live component (name,
shape, dtype, finite: the error names the tensor) and builds the new modules; generation goes on
meanwhile. ``StagedSync.apply`` then runs on the engine's thread between two ticks (no step runs
and nothing is admitted while it does): each component's new module goes live, its
``weights_version`` bumps, and only the cached features of the replaced version are dropped.
Requests pin their components' versions at init (``state.values["weights_versions"]``), so those
admitted before the swap finish bit for bit on the old weights (the replaced module stays resident
until none of them uses it) and those after run on the new ones; a version is part of their batch
keys, so the two never share a call.
"""

from __future__ import annotations

import json
import secrets
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from fv_core.errors import ConfigError, WeightsError

VERSION_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:+-]{0,127}$"  # goes into cache keys, batch keys, provenance


class WeightSyncPlan(BaseModel):
    """What a weight sync replaces: ``role``'s weights of ``components``, live as ``version``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    role: str = "student"  # a training Role (student, ema, ...): whose weights these are
    components: list[str] = Field(min_length=1)  # components the payload replaces
    version: str = Field(pattern=VERSION_PATTERN)  # their new weights_version (e.g. "step-100")

    @field_validator("role")
    @classmethod
    def _known_role(cls, role: str) -> str:
        from fv_core.training import Role

        roles = [r.value for r in Role]
        if role not in roles:
            raise ValueError(f"role {role!r} is not a training role; use one of {roles}")
        return role

    @field_validator("components")
    @classmethod
    def _unique(cls, components: list[str]) -> list[str]:
        if len(set(components)) != len(components):
            raise ValueError(f"components {components} name one twice; name each once")
        return components


@dataclass(slots=True)
class SyncResult:
    """What a sync did."""

    role: str  # the plan's role
    versions: dict[str, str]  # component -> its new weights_version
    previous: dict[str, str]  # component -> the version it replaced
    tensors: dict[str, int]  # component -> tensors replaced
    cache_entries_dropped: int  # cached features of the replaced versions that went
    pinned: list[str] = field(default_factory=list)  # requests still running on a replaced version


@dataclass(slots=True)
class StagedSync:
    """A checked plan with its new modules built; ``apply`` swaps them in at a step boundary."""

    instance: Any  # the live model instance
    plan: WeightSyncPlan
    modules: dict[str, torch.nn.Module]  # component -> new module
    base: dict[str, str]  # component -> the version the new module was built from
    counts: dict[str, int]  # component -> tensors replaced

    def apply(self, scheduler: Any = None) -> SyncResult:
        """Swap every component of the plan in (call between two ticks: ``engine.at_boundary``).
        ``scheduler`` knows which requests pin which versions (None: nothing is running)."""
        inst, plan = self.instance, self.plan
        for name in plan.components:
            live = inst.weights_versions[name]
            if live != self.base[name]:
                raise ConfigError(
                    f"{name!r} changed from version {self.base[name]!r} to {live!r} while this sync was "
                    "staged (another sync landed first). Fix: push again on top of the live weights.",
                    param="version",
                )
            _check_unused(inst, name, plan.version)
        pins: dict[str, dict[str, str]] = scheduler.pins(inst) if scheduler is not None else {}
        pinned = {pin for versions in pins.values() for pin in versions.items()}
        dropped = sum(
            inst.swap_weights(name, self.modules[name], plan.version, pinned) for name in plan.components
        )
        dropped += inst.release_versions(pinned)
        on_old = sorted(
            rid
            for rid, versions in pins.items()
            if any(versions.get(n) == self.base[n] for n in plan.components)
        )
        return SyncResult(
            plan.role,
            {n: plan.version for n in plan.components},
            dict(self.base),
            dict(self.counts),
            dropped,
            on_old,
        )


Weights = torch.nn.Module | Mapping[str, Any]  # a module, a state dict, or component -> either


def payload(plan: WeightSyncPlan, weights: Weights) -> dict[str, torch.Tensor]:
    """The tensors to send, keyed ``"<component>.<name>"``. ``weights``: the one component's module or
    state dict, or (for several components) a mapping of component -> module or state dict."""
    if isinstance(weights, Mapping) and set(weights) == set(plan.components):
        parts = dict(weights)
    elif len(plan.components) == 1:
        parts = {plan.components[0]: weights}
    else:
        raise ConfigError(
            f"the plan names components {plan.components}; weights must map each of them to its module or "
            f"state dict (got keys {sorted(weights)[:5] if isinstance(weights, Mapping) else type(weights).__name__}). "
            "Fix: pass {component: module, ...}."
        )
    out: dict[str, torch.Tensor] = {}
    for component, part in parts.items():
        state = part.state_dict() if isinstance(part, torch.nn.Module) else part
        for key, tensor in state.items():
            if not isinstance(tensor, torch.Tensor):
                raise ConfigError(
                    f"{component}.{key} is a {type(tensor).__name__}, not a tensor. Fix: send tensors."
                )
            out[f"{component}.{key}"] = tensor.detach().to("cpu").contiguous()
    return out


def encode(plan: WeightSyncPlan, weights: Weights) -> bytes:
    """The payload as one safetensors file (what ``POST /v1/weights`` takes)."""
    from safetensors.torch import save

    return save(payload(plan, weights), metadata={"fv.sync.version": plan.version, "fv.sync.role": plan.role})


def split(
    plan: WeightSyncPlan, tensors: Mapping[str, torch.Tensor] | bytes
) -> dict[str, dict[str, torch.Tensor]]:
    """Component -> its tensors, from a payload (``"<component>.<name>"`` keys, or safetensors bytes)."""
    if isinstance(tensors, (bytes, bytearray)):
        from safetensors.torch import load

        try:
            tensors = load(bytes(tensors))
        except Exception as exc:  # safetensors raises its own error types
            raise WeightsError(
                f"the weights are not a readable safetensors file ({exc}). "
                "Fix: send safetensors.torch.save(tensors) bytes (fv_core.training.sync.encode)."
            ) from None
    parts: dict[str, dict[str, torch.Tensor]] = {name: {} for name in plan.components}
    for key, tensor in tensors.items():
        component, _, name = key.partition(".")
        if component not in parts or not name:
            raise WeightsError(
                f"tensor {key!r} belongs to no component of the plan {plan.components}: payload keys are "
                "'<component>.<tensor name>'. Fix: send only the plan's components, prefixed by their names."
            )
        parts[component][name] = tensor
    empty = [name for name, part in parts.items() if not part]
    if empty:
        raise WeightsError(
            f"the payload has no tensors for {empty}. Fix: send them, or drop them from the plan."
        )
    return parts


def stage_sync(model: Any, plan: WeightSyncPlan, weights: Weights | bytes) -> StagedSync:
    """Check ``plan`` and ``weights`` against the live ``model`` (a LoadedModel or its instance) and build
    the new modules; nothing live changes. Raises ConfigError / WeightsError naming the problem."""
    inst = getattr(model, "instance", model)
    if not all(hasattr(inst, m) for m in ("stage_weights", "swap_weights", "release_versions")):
        card = getattr(getattr(inst, "card", None), "model_id", type(inst).__name__)
        raise ConfigError(
            f"model {card!r} does not take weight syncs (its instance has no stage_weights / swap_weights). "
            "Fix: sync a model whose family supports it (fv-wan, fv-ltx2, fv-bagel)."
        )
    tensors = weights if isinstance(weights, (bytes, bytearray)) else payload(plan, weights)
    parts = split(plan, tensors)
    base, modules = {}, {}
    for name, part in parts.items():
        if name in getattr(inst, "weights_versions", {}):
            _check_unused(inst, name, plan.version)
        base[name] = inst.weights_versions.get(name, "")
        with torch.no_grad():
            modules[name] = inst.stage_weights(name, part)
    return StagedSync(inst, plan, modules, base, {n: len(p) for n, p in parts.items()})


def sync_weights(
    model: Any, plan: WeightSyncPlan, weights: Weights | bytes, engine: Any = None
) -> SyncResult:
    """Put ``weights`` live in ``model`` as ``plan`` says. Without ``engine`` the swap happens now (no
    request may be running on the model); with one (an Engine, AsyncEngine or Scheduler running the
    model's requests) at its next step boundary, waiting for it (call from another thread than the
    one ticking it)."""
    staged = stage_sync(model, plan, weights)
    if engine is None:
        return staged.apply()
    return engine.at_boundary(staged.apply).result()


def push_weights(
    url: str,
    plan: WeightSyncPlan,
    weights: Weights,
    *,
    api_key: str | None = None,
    model: str | None = None,
    timeout: float = 600.0,
) -> dict[str, Any]:
    """Send ``weights`` to an ``fv serve`` at ``url`` (``POST /v1/weights``, authenticated like the API);
    returns its answer (``versions``, ``previous``, ``cache_entries_dropped``, ``pinned``, ...).
    ``model``: the served model name (default: the server's first). Raises ConfigError with the
    server's message when it refuses."""
    fields = {"plan": plan.model_dump_json(), **({"model": model} if model is not None else {})}
    body, content_type = _multipart(fields, ("weights", "weights.safetensors", encode(plan, weights)))
    headers = {"Content-Type": content_type}
    if api_key is not None:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(f"{url.rstrip('/')}/v1/weights", body, headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read())["error"]["message"]
        except Exception:
            message = str(exc)
        raise ConfigError(f"{url} refused the weight sync (HTTP {exc.code}): {message}") from None


def _check_unused(inst: Any, name: str, version: str) -> None:
    """A new version must differ from the live one and from those still resident for running requests."""
    taken = {inst.weights_versions[name], *(v for n, v in inst.retired_versions if n == name)}
    if version in taken:
        raise ConfigError(
            f"version {version!r} of {name!r} is already resident (live: {inst.weights_versions[name]!r}); "
            "cached features and batches are keyed by it. Fix: give these weights a new version.",
            param="version",
        )


def _multipart(fields: dict[str, str], file: tuple[str, str, bytes]) -> tuple[bytes, str]:
    """A multipart/form-data body of text ``fields`` and one ``(field, filename, bytes)`` file."""
    boundary = f"fv-{secrets.token_hex(16)}"
    chunks = [
        f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
        for k, v in fields.items()
    ]
    name, filename, data = file
    chunks.append(
        f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; filename="{filename}"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n".encode()
    )
    chunks += [data, f"\r\n--{boundary}--\r\n".encode()]
    return b"".join(chunks), f"multipart/form-data; boundary={boundary}"


__all__ = [
    "StagedSync",
    "SyncResult",
    "WeightSyncPlan",
    "encode",
    "payload",
    "push_weights",
    "split",
    "stage_sync",
    "sync_weights",
]
