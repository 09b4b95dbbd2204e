"""The driven-loop contract: a loop describes steps, the runtime runs them.

A loop is a state machine ``init -> (next -> advance)* -> finalize``.
``next`` is kernel-free: it returns a :class:`WorkPlan` that *describes* the
step (a pure step body plus its inputs); the runtime decides when, and with
which other requests' plans, the body runs. All per-request state lives in
:class:`LoopState`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch


class WorkUnitKind(str, enum.Enum):
    """The 13 kinds of schedulable work (design section 6)."""

    AR_TOKEN = "ar_token"
    AR_PREFILL = "ar_prefill"
    DIFFUSION_STEP = "diffusion_step"
    DIFFUSION_WINDOW = "diffusion_window"
    CHUNK_STEP = "chunk_step"
    ENCODER_CHUNK = "encoder_chunk"
    VAE_TILE = "vae_tile"
    AUDIO_CHUNK = "audio_chunk"
    REWARD_BATCH = "reward_batch"
    LOGPROB_BATCH = "logprob_batch"
    TRANSFER = "transfer"
    CACHE_IO = "cache_io"
    GRAPH_CAPTURE = "graph_capture"


class LoopKind(str, enum.Enum):
    """What a loop iterates over."""

    DIFFUSION_DENOISE = "diffusion_denoise"
    AR_DECODE = "ar_decode"
    CHUNK_ROLLOUT = "chunk_rollout"
    ENCODE = "encode"
    VAE_DECODE = "vae_decode"
    AUDIO_DECODE = "audio_decode"


class Profile(str, enum.Enum):
    """Execution profiles sharing one loop definition."""

    SERVE = "serve"  # no grad, no capture
    ROLLOUT = "rollout"  # serve + behaviour capture
    TRAIN = "train"  # grad enabled


@dataclass(frozen=True, slots=True)
class BatchKey:
    """Plans with equal keys may run as one batched call."""

    instance: str  # model instance id (same live weights)
    loop_kind: str  # LoopKind value
    shape_sig: tuple  # per-sample input shapes, excluding the batch dim
    precision: str  # dtype name
    parallel_plan: str = "single"  # parallel plan id
    graph_key: str = ""  # anything else that changes the compiled body (e.g. body variant)


SEGMENTS = "segments"  # the input a packed call adds: packed input -> each plan's length (WorkPlan.packed)

StepBody = Callable[[dict[str, Any]], dict[str, Any]]


@dataclass(slots=True)
class StreamEvent:
    """One event on a request's stream."""

    kind: str  # "progress", "partial", "done", "error", "cancelled"
    request_id: str
    step: int = 0  # steps finished so far
    total: int | None = None  # total steps when known
    data: Any = None  # partial output or payload


@dataclass(slots=True)
class WorkPlan:
    """A kernel-free description of one step.

    ``body(inputs)`` runs the step alone. When ``batch_key`` is set, the
    runtime may instead concatenate the tensor ``inputs`` of several plans
    with equal keys along dim 0 (``batch_size`` rows each), call ``body`` once
    and split the tensor outputs back; non-tensor inputs must then be equal.

    Packed form (``packed``): requests of different token counts share one call as one sequence. The
    inputs named in ``packed`` (each plan one row: ``batch_size`` 1) are concatenated along their token
    dim instead of the batch dim; a non-tensor input named there becomes a tuple, one value per plan.
    The body then also gets ``inputs[SEGMENTS]``: packed input -> each plan's length along its dim, in
    plan order, and keeps each plan's tokens to themselves (attention within a segment only). Outputs
    named in ``packed_outputs`` are split back along the dim of the packed input they follow. A plan
    run alone gets no ``SEGMENTS``: its body runs the plain path.

    Batch invariance (``invariant_body``): the same step as ``body`` with each batched row's outputs bit
    for bit what ``body`` gives that plan alone, whatever shares the call (each row's reductions in a
    fixed order: see ``fv_core.loop.invariant``). Under ``determinism: bitwise`` plans batch only through it
    (plans without one run alone); the other modes batch through ``body``. A loop sets it only where the
    equality is measured (tests assert it, and that ``body`` batched would differ where it does).
    """

    kind: WorkUnitKind  # which of the 13 kinds
    body: StepBody  # pure function of inputs: no per-request state inside
    inputs: dict[str, Any]  # tensors with a leading batch dim, plus plain values
    batch_key: BatchKey | None = None  # None: never batched
    batch_size: int = 1  # rows this plan contributes to a batch
    cost_s: float = 0.0  # predicted seconds (filled from the cost model when 0)
    peak_bytes: int = 0  # worst-case transient memory of this step
    emits: tuple[str, ...] = ("progress",)  # stream event kinds this step produces
    label: str = ""  # human-readable name, e.g. "denoise 3/30"
    # tensor input -> a dim along which plans of one batch may differ: each is zero-padded (False for
    # bool masks) to the longest along it before concatenation (ragged contexts with a valid mask)
    ragged: dict[str, int] = field(default_factory=dict)
    # packed form (see above): input -> its token dim (any int for a non-tensor per-plan value)
    packed: dict[str, int] = field(default_factory=dict)
    packed_outputs: dict[str, str] = field(default_factory=dict)  # output -> the packed input it follows
    invariant_body: StepBody | None = None  # batched rows bit for bit each plan alone (see above)


@dataclass(slots=True)
class StepResult:
    """What running a plan produced, folded back by ``Loop.advance``."""

    outputs: dict[str, Any]  # the body's outputs for this plan's rows only
    seconds: float = 0.0  # measured wall time attributed to this plan
    batched_with: int = 1  # how many plans shared the call
    timed: bool = True  # False: the seconds are skewed (memory peak tracking); the cost model skips them


@dataclass(slots=True)
class Done:
    """Returned by ``Loop.next`` when the loop has no more steps."""

    reason: str = "finished"  # "finished", "eos", "max_tokens", "early_exit"


@dataclass(slots=True)
class LoopState:
    """All per-request state of one loop run; a resume point.

    Nothing per-request may live anywhere else (module globals, shared
    modules). ``plugin_state[plugin_id][branch]`` belongs to interceptors.
    """

    request_id: str  # owning request
    loop_id: str  # LoopSpec id within the card
    step: int = 0  # steps advanced so far
    total_steps: int | None = None  # known step count, None if open-ended
    generator: torch.Generator | None = None  # seeded per-request RNG
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # latents, embeddings, KV handles
    values: dict[str, Any] = field(default_factory=dict)  # plain per-request values (json-able)
    plugin_state: dict[str, dict[str, Any]] = field(default_factory=dict)  # interceptor state
    done: bool = False  # set when finished or cancelled


@dataclass(slots=True)
class LoopResult:
    """Outputs of a finished loop."""

    outputs: dict[str, Any]  # named outputs (tensors, artifacts)
    metrics: dict[str, Any] = field(default_factory=dict)  # steps, cache stats, timings
    behavior: Any = None  # BehaviorRecord under the rollout profile


@runtime_checkable
class Loop(Protocol):
    """The four methods the runtime requires of every loop."""

    def init(self, request: Any, instance: Any, ctx: Any) -> LoopState: ...

    def next(self, state: LoopState) -> WorkPlan | Done: ...

    def advance(self, state: LoopState, result: StepResult) -> LoopState: ...

    def finalize(self, state: LoopState) -> LoopResult: ...
