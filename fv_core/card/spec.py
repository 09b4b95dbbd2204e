"""Model cards: the declarative contract of a servable model.

A card owns its components, loops, recipe and parity contract. It is plain
pydantic data (unknown fields rejected) so it can be validated, printed and
compared before any weight is touched.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field

from fv_core.errors import ConfigError
from fv_core.loop.contracts import LoopKind, WorkUnitKind

ConsistencyLevel = Literal["C0", "C1", "C2", "C3", "C4"]
PartKind = Literal["text", "image", "video", "audio"]  # kinds of request inputs and of artifacts


# fields cards used to have -> where their values live now
MOVED = {
    "defaults": "cards no longer carry defaults at the top level; a task's defaults are "
    "card.programs[TASK].defaults. Fix: set those, or register a "
    "CardVariant(model_id=..., parent=..., defaults={TASK: {...}})",
}


class Spec(BaseModel):
    """Base of every card section: strict, immutable-by-convention data.

    An unknown field is an error naming the fix at construction (``extra="forbid"``), on assignment and
    in ``model_copy(update=...)``, which pydantic would otherwise keep, unvalidated, without a word."""

    model_config = ConfigDict(extra="forbid", frozen=False)

    @classmethod
    def _refuse_unknown(cls, names: Iterable[str]) -> None:
        for name in names:
            if name not in cls.model_fields:
                why = MOVED.get(name, f"its fields are {sorted(cls.model_fields)}. Fix: use one of those")
                raise ConfigError(f"{cls.__name__} has no field {name!r}: {why}.", param=name)

    def __setattr__(self, name: str, value: Any) -> None:
        if not name.startswith("_"):
            self._refuse_unknown([name])
        super().__setattr__(name, value)

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        self._refuse_unknown(update or ())
        return super().model_copy(update=update, deep=deep)


class ComponentSpec(Spec):
    """One loadable part of a model (transformer, VAE, text encoder, ...)."""

    kind: str  # "dit", "vae", "text_encoder", "tokenizer", "scheduler", ...
    load_id: str  # "module:attr" of the class or loader
    subfolder: str | None = None  # folder inside the checkpoint layout
    required_for: set[str] = Field(default_factory=set)  # tasks that need it loaded
    optional_for: set[str] = Field(default_factory=set)  # tasks that may use it
    resident_for: set[str] = Field(default_factory=set)  # tasks that keep it resident between requests
    precision: str = "float32"  # default dtype
    config: dict[str, Any] = Field(
        default_factory=dict
    )  # values the folder's config must hold (``_class_name``, layer count, dims), checked at load


class StepCostModel(Spec):
    """Predicted seconds per step: ``base_s + per_token_s * tokens``."""

    base_s: float = 0.0
    per_token_s: float = 0.0
    peak_bytes_per_token: int = 0  # worst-case transient memory per token


class StepsContract(Spec):
    """Which step counts (and timesteps) a loop may be driven with."""

    min_steps: int = 1
    max_steps: int = 1000
    fixed_timesteps: list[int] | None = None  # distilled loops pin their timesteps


class LoopSpec(Spec):
    """A loop this card can run and what it binds."""

    kind: LoopKind
    work_unit_kind: WorkUnitKind
    loop_factory: str  # "module:attr" returning a Loop
    components: list[str] = Field(default_factory=list)  # components the loop drives
    shared_weight_components: list[str] = Field(default_factory=list)  # bound to the same live instance
    cache_policy: list[str] = Field(default_factory=list)  # cache contracts the loop uses
    step_cost: StepCostModel = Field(default_factory=StepCostModel)
    steps: StepsContract = Field(default_factory=StepsContract)
    samplers: list[str] = Field(default_factory=list)  # sampler names the loop accepts
    params: str = "fv_core.request.params:Params"  # "module:attr" of the loop's typed request Params
    variant_of: str | None = (
        None  # the loop whose weights and step contract this one shares (e.g. i2v of t2v)
    )
    accepts: list[PartKind] = Field(default_factory=list)  # input parts the loop takes besides its params
    requires: list[PartKind] = Field(default_factory=list)  # of those, kinds a request must send exactly once


class ProgramSpec(Spec):
    """A named task: loops of this card run in order against one instance.

    The request's Params are the program's (default: the first stage's loop's); ``defaults`` are
    this card's values for them (a card variant overrides them)."""

    stages: list[str]  # loop ids, run in order
    params: str | None = None  # "module:attr" of this task's request Params; None: its first loop's
    binds: dict[int, str] = Field(
        default_factory=dict
    )  # stage index -> "module:attr" (request, earlier results) -> that stage's request
    defaults: dict[str, Any] = Field(default_factory=dict)  # Params field -> this card's default
    outputs: list[PartKind] = Field(default_factory=lambda: list[PartKind](["video"]))  # artifacts it yields
    description: str = ""


class RecipeSpec(Spec):
    """What produced the weights, and the loop they assume."""

    method: str = "base"  # base, finetune, dmd2, self_forcing, diffusion_nft, ...
    parents: list[str] = Field(default_factory=list)  # teacher / base card ids
    assumes_loop: str  # the loop id the weights were made for
    assumes_precision: str = "float32"
    consistency_required: ConsistencyLevel = "C1"
    description: str = ""


class ParitySpec(Spec):
    """How this card's outputs are checked."""

    level: ConsistencyLevel = "C1"
    reference: str | None = None  # external oracle, e.g. "diffusers:WanPipeline"
    tolerances: dict[str, float] = Field(default_factory=dict)  # per tap / output, max abs
    interleave_gate: bool = True  # N interleaved == N serial, bit for bit


class CapabilityMatrix(Spec):
    """What the card accepts and its size limits (its tasks are its programs)."""

    interceptors: set[str] = Field(default_factory=set)  # accepted interceptor kinds: step_skip, block_skip
    max_frames: int | None = None
    max_resolution: tuple[int, int] | None = None  # (height, width)


DEFAULT_CACHE_BYTES = 64 << 20  # a cache's byte budget unless the card sets one


class CacheContract(Spec):
    """A cache a loop may use, with every key field that can change the output."""

    kind: Literal["feature", "residual", "kv"]
    key_fields: list[str]  # CacheKey fields, e.g. model, component, weights_version, content_hash
    component: str | None = None  # component whose weights version scopes the entries
    capacity: int = Field(default=256, ge=1)  # max entries
    # byte budget: LRU entries are evicted until the stored bytes fit; an instance's resident bytes
    # (what admission reserves) count each cache at this budget. None: bounded by ``capacity`` only.
    max_bytes: int | None = Field(default=DEFAULT_CACHE_BYTES, ge=1)


class ParallelismContract(Spec):
    """Parallel axes the card supports and their maximum degree."""

    axes: dict[str, int] = Field(default_factory=lambda: {"dp": 1})  # axis -> max degree


class AdapterContract(Spec):
    """The LoRA adapters a card takes per request (``fv_core.adapters``)."""

    # "module:Class" of the diffusers LoRA loader mixin whose ``lora_state_dict`` reads (and converts) this
    # family's LoRA files, e.g. "diffusers.loaders.lora_pipeline:WanLoraLoaderMixin"
    loader: str
    components: list[str] = Field(
        min_length=1
    )  # components an adapter may target; the first takes PEFT folders
    scale_range: tuple[float, float] = (-4.0, 4.0)  # scales a request may give an adapter


class PrecisionContract(Spec):
    """Precisions the card may run in."""

    supported: list[str] = Field(default_factory=lambda: ["float32"])
    default: str = "float32"


class ModelCard(Spec):
    """A servable (recipe, runtime) pair."""

    model_id: str
    family: str
    description: str = ""
    components: dict[str, ComponentSpec]
    loops: dict[str, LoopSpec]
    programs: dict[str, ProgramSpec]  # task name -> program; the first is the default task
    recipe: RecipeSpec
    parity: ParitySpec = Field(default_factory=ParitySpec)
    capabilities: CapabilityMatrix = Field(default_factory=CapabilityMatrix)
    caches: dict[str, CacheContract] = Field(default_factory=dict)
    parallelism: ParallelismContract = Field(default_factory=ParallelismContract)
    precision: PrecisionContract = Field(default_factory=PrecisionContract)
    adapters: AdapterContract | None = None  # None: the card takes no LoRA adapters
    kernels: dict[str, str] = Field(default_factory=dict)  # op -> selected variant (filled at assembly)
    # op -> the kernel variants its model code runs ("*": any registered one); ``fv_core.load`` refuses others
    accepts_kernels: dict[str, list[str]] = Field(default_factory=lambda: {"attention": ["sdpa"]})
    default_weights: str | None = None  # "module:attr" that materializes embedded weights, returns a path
    # the Hugging Face repo publishing this card's weights ("owner/name[@revision]"): fetched (or found
    # in the local cache) by ``fv_core.load`` when no weights are given and none are embedded
    weights_repo: str | None = None
    instance_factory: str | None = (
        None  # "module:attr" called (card, weights, device[, kernels=]) -> instance
    )
    pipeline: str | None = None  # model_index.json ``_class_name`` of the weights this card runs
    parent: str | None = None  # card this one was derived from (a CardVariant), if any

    def accepts_kernel(self, op: str, variant: str) -> bool:
        """Whether this card's model code runs ``variant`` for ``op``."""
        accepted = self.accepts_kernels.get(op, [])
        return "*" in accepted or variant in accepted

    @property
    def tasks(self) -> list[str]:
        """Task names, the default first."""
        return list(self.programs)

    def params_of(self, task: str) -> str:
        """The ``"module:attr"`` of ``task``'s request Params (the program's, else its first loop's)."""
        program = self.programs[task]
        return program.params or self.loops[program.stages[0]].params


class CardVariant(Spec):
    """A card derived from a registered one: its own id, description and defaults; the same weights,
    loops and components. Register it like a card; assembly builds it from ``parent``."""

    model_id: str
    parent: str  # the registered card it derives from
    description: str = ""  # default: the parent's
    defaults: dict[str, dict[str, Any]] = Field(
        default_factory=dict
    )  # task -> Params defaults overriding the parent's
