"""The typed per-request state of BAGEL's loops.

Each loop keeps its state in one plain, json-able dict, ``state.values["bagel"]`` (``save_state`` writes
it as it is; the core's pins stay in ``state.values["weights_versions"]``), and reads and writes it by
attribute through a typed view: :meth:`Typed.of` returns the dataclass whose fields ARE that dict.

Context segments (pending prefills) are plain dicts: ``{"kind": "text", "ids": [...]}``, ``{"kind":
"image", "index": i}`` (the ``image{i}.*`` tensors) or ``{"kind": "vae"}`` (the edited image). A context
is ``{"seq": {"pages", "length"}, "rope": next RoPE position}`` (and ``"net"``: the version that wrote
it, on a context handed to a later stage).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeVar

from fv_core.loop import LoopState

KEY = "bagel"  # state.values key of the loop's own state
T = TypeVar("T", bound="Typed")


class Typed:
    """A dataclass over ``state.values[KEY]``: attribute reads and writes go to that dict."""

    @classmethod
    def of(cls: type[T], state: LoopState) -> T:
        """The typed view of ``state``'s own values."""
        view = object.__new__(cls)
        view.__dict__ = state.values[KEY]
        return view

    def put(self, state: LoopState) -> None:
        """Make this the state's own values (at init)."""
        state.values[KEY] = self.__dict__


@dataclass
class ChatState(Typed):
    """AR decode (``chat``, the thinking of ``think-t2i``)."""

    segments: list[dict[str, Any]]  # context segments still to prefill, in order
    token: int  # the token the next decode step feeds (first: <|im_start|>)
    max_tokens: int  # most tokens to generate
    temperature: float  # sampling (0: greedy)
    top_p: float
    top_k: int
    stop: list[str]  # stop strings (not returned)
    keep_contexts: bool  # hand the context after each segment to a later stage (think-t2i)
    seq: dict[str, Any] | None = field(
        default_factory=lambda: {"pages": [], "length": 0}
    )  # the context's pages
    rope: int = 0  # the context's next RoPE position
    generated: list[int] = field(default_factory=list)  # sampled tokens (EOS excluded)
    text: str = ""  # their text, cut at a stop string
    stop_reason: str | None = None  # eos, stop or max_tokens once stopped
    streamed: int = 0  # characters of ``text`` already streamed
    kept: list[dict[str, Any]] = field(default_factory=list)  # forks of the context kept for a later stage
    keys: list[Any] = field(default_factory=list)  # each context token's prefix-cache key (text: its id)
    reused: int = 0  # context tokens served by the prefix cache (not prefilled)
    held: int = 0  # pages reserved for the served prefix at init (admission reserves the rest)
    wait: int = 0  # tokens of a prefix another request is prefilling that this one waits for (0: none)
    waited: int = 0  # idle steps it has waited
    speculative_k: int = 0  # tokens drafted per step (0: one token a step)
    speculative_ngram: int = 3  # the longest n-gram matched to draft
    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # of them, those the model's own choice confirmed
    prompt_tokens: int = 0  # the context's length when decoding began
    decode_start: float | None = None  # when the first decode step's result came (tokens/s)


@dataclass
class DenoiseState(Typed):
    """Image denoise (``t2i``, ``edit``, the image of ``think-t2i``)."""

    ctx: dict[str, dict[str, Any]]  # the CFG contexts by name: cond, text_uncond, img_uncond
    pending: list[tuple[str, str, dict[str, Any]]]  # prefills to run: (context written, extended, segment)
    aliases: dict[str, str]  # a context that IS another one (t2i: img_uncond is cond), not a copy
    thinking: str | None  # think-t2i: the AR stage's plan in the conditional context
    times: list[float]  # flow times the steps run at (1 -> 0, shifted)
    dts: list[float]  # their Euler step sizes
    grid_shape: list[int]  # latent patches: rows, cols
    cfg_text_scale: float  # guidance (the request's params)
    cfg_img_scale: float
    cfg_interval: list[float]  # guidance runs while lo < t <= hi
    cfg_renorm_type: str
    cfg_renorm_min: float
    phase: str = "prefill"  # prefill, denoise, decode, done
    branches_run: list[int] = field(default_factory=list)  # CFG rows each step ran
    cond_keys: list[Any] | None = None  # the conditional context's prefix-cache keys (None: not cached)
    reused: int = 0  # context tokens served by the prefix cache (not prefilled)
    held: int = 0  # pages reserved for the served prefix at init (admission reserves the rest)
