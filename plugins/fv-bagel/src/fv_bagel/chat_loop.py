"""BAGEL's AR decode loop (task ``chat``; the thinking of ``think-t2i``): prefill the conversation's
texts and images and the prompt, then one token per step. A chat's prompt is prefilled with the first
token step's input (``<|im_start|>``) in one causal block, and its first token sampled from that block's
last logits: the first token comes one call sooner, the same token (the same keys/values, bit for bit on
the row-invariant path).

Each token step feeds the last token at the next position and appends its keys/values; sampling
(greedy / temperature / top-k / top-p), EOS, stop strings and ``max_tokens`` run in ``advance`` on the
request's own generator. Token steps of different requests batch as rows whatever their context
lengths (:mod:`fv_bagel.context`). ``kv_need`` tells admission the most pages the request can hold at
once, so a request waits for pages instead of running out of them mid-decode.

The context starts from the longest prefix the instance's prefix cache holds (:mod:`fv_bagel.prefill`),
or from what a request arriving with it is prefilling, once it has (:mod:`fv_bagel.sharing`); the
finished context (the decoded tokens too) is recorded there, so the next turn of a conversation
prefills only what it adds. think-t2i's thinking starts from the cache too: the context after each
segment served whole is kept for the image stage as a prefilled one is.

Speculative decoding (``speculative_k`` > 0): each step drafts up to k tokens by prompt lookup (the
latest earlier occurrence of the context's last n-gram, ``speculative_ngram`` down to 1 token, and the
tokens that followed it) and feeds the last token and the draft as one causal block. The step's logits
after every position are sampled in order, on the request's generator, exactly as one token a step would
sample them; a draft token is accepted while it equals the token sampled before it, and the first token
that differs ends the step (it is the next step's input). So the output is the same token for token; only
the keys/values of accepted tokens are kept.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any

import torch

from fv_bagel import bodies
from fv_bagel.context import RAGGED_CONTEXT, check_positions, plain, plan_inputs, text_ids, written
from fv_bagel.images import understood
from fv_bagel.prefill import PrefillLoop
from fv_bagel.sharing import MAX_WAITS, wait_plan
from fv_bagel.state import ChatState
from fv_core.kv import KVSeq, PagedKVPool
from fv_core.loop import Done, LoopResult, LoopState, StepResult, WorkPlan, WorkUnitKind, pinned, pinned_state

VLM_THINK_SYSTEM_PROMPT = (  # BAGEL's system prompt for thinking before an answer (inferencer.py)
    "You should first think about the reasoning process in the mind and then provide the user with the answer. \n"
    "The reasoning process is enclosed within <think> </think> tags, i.e. <think> reasoning process here </think> "
    "answer here"
)


class ChatLoop(PrefillLoop):
    """AR decode (task ``chat``): prefill the images and the prompt, then one token per step."""

    def init(self, request: Any, instance: Any = None, ctx: Any = None) -> LoopState:
        inst = self.instance
        p = request.params
        segments = []
        system = request.carry.get("system_prompt") or (VLM_THINK_SYSTEM_PROMPT if p.think else None)
        if system:
            segments.append({"kind": "text", "ids": text_ids(inst, system)})
        # pinned first: every plan runs on these versions
        state = pinned_state(request, inst, inst.card.programs[request.task].stages[0])
        segments += self._add_parts(state, request)
        segments.append({"kind": "text", "ids": text_ids(inst, p.prompt)})
        prefix = sum(self._tokens(state, s) for s in segments)
        check_positions(
            self._net(state),
            prefix + p.max_tokens + 1,
            f"a prompt of {prefix} tokens plus max_tokens={p.max_tokens}",
        )
        s = ChatState(
            segments=segments,
            token=inst.special["bos_token_id"],  # the first decode step feeds <|im_start|>
            max_tokens=p.max_tokens,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            stop=list(p.stop),
            keep_contexts=bool(request.carry.get("keep_contexts")),
            speculative_k=p.speculative_k,
            speculative_ngram=p.speculative_ngram,
        )
        s.put(state)
        self._start(state, s, first=True)
        return state

    def _start(self, state: LoopState, s: ChatState, first: bool) -> None:
        """Start the context from the longest prefix the prefix cache holds (think-t2i: with the context
        after each segment it serves whole kept for the next stage, as a prefilled one is); at init
        (``first``), unless a request prefilling meanwhile shares at least a page more: then wait for it
        (:mod:`fv_bagel.sharing`). After a wait the pages reused are not reserved: admission counted them."""
        inst = self.instance
        flat = self._flat(state, s.segments)
        if first and inst.prefix is not None and flat:
            namespace = self._namespace(state)
            shared = inst.prefilling.shared(state.request_id, namespace, flat)
            if shared >= inst.prefix.match(namespace, flat) + inst.kv_pool.page_size:
                s.wait, s.waited = shared, 0
                return
        seq, rope, keys, left, ends = self._served(state, s.segments, reserve=first)
        s.seq, s.rope, s.keys, s.reused, s.wait = plain(seq), rope, keys, seq.length, 0
        s.held = len(seq.pages) if first else 0
        if s.keep_contexts:
            pool = inst.kv_pool
            for length, at in ends:
                fork = pool.truncate(pool.fork(seq), length)
                s.kept.append({"seq": plain(fork), "rope": at, "net": pinned(state, "net")})
            s.segments = left
        else:  # consecutive texts prefill as one causal block: one step, the same keys/values
            s.segments = merged(left)
        if s.segments:
            inst.prefilling.add(state.request_id, self._namespace(state), flat)
        else:
            s.decode_start = time.perf_counter()

    def _flat(self, state: LoopState, segments: list[dict[str, Any]]) -> list[Any]:
        """The prefix-cache keys of the context's tokens, as far as the cache can hold them."""
        return [k for keys in self._segment_keys(state, segments) for k in keys]

    def _waiting(self, state: LoopState, s: ChatState) -> bool:
        """Whether to wait on for the shared prefix: the cache does not hold it yet, the request prefilling
        it has not left, and the waits are not spent."""
        inst = self.instance
        if inst.prefix is None or s.waited >= MAX_WAITS:
            return False
        namespace, flat = self._namespace(state), self._flat(state, s.segments)
        held = inst.prefix.match(namespace, flat)
        return held < s.wait and inst.prefilling.shared(state.request_id, namespace, flat) >= s.wait

    def _add_parts(self, state: LoopState, request: Any) -> list[dict[str, Any]]:
        """The request's text and image parts as context segments, in order (a conversation so far:
        BAGEL's interleaved input has no roles, each text is one ``<|im_start|> ... <|im_end|>`` span)."""
        segments: list[dict[str, Any]] = []
        images = 0
        for part in request.parts:
            if part.kind == "text":
                segments.append({"kind": "text", "ids": text_ids(self.instance, part.text)})
                continue
            patches, ids = understood(self.instance, self._net(state), part.image, request.params)
            state.tensors[f"image{images}.patches"], state.tensors[f"image{images}.ids"] = patches, ids
            segments.append({"kind": "image", "index": images})
            images += 1
        return segments

    def _ctx(self, s: ChatState) -> dict[str, Any]:
        return {"seq": s.seq, "pool": self.instance.kv_pool, "rope": s.rope}

    def _append(
        self, s: ChatState, k: torch.Tensor, v: torch.Tensor, rope_advance: int, keys: list[Any]
    ) -> None:
        """Write a block's keys/values after the context (into this request's own pages)."""
        assert s.seq is not None, "released contexts take no more tokens"
        seq = self.instance.kv_pool.append(KVSeq(**s.seq), k, v)
        s.seq = {"pages": seq.pages, "length": seq.length}
        s.rope += rope_advance
        s.keys += keys

    def kv_need(self, state: LoopState) -> tuple[PagedKVPool, int]:
        """The pool and the most pages this request holds at once: its context at its longest (the pending
        segments, then a token per step up to ``max_tokens``), plus one page per context kept for a later
        stage (a kept fork keeps the partly filled page the growing context then copies)."""
        pool, s = self.instance.kv_pool, ChatState.of(state)
        assert s.seq is not None, "a released request holds no pages"
        left = sum(self._tokens(state, segment) for segment in s.segments)
        if s.stop_reason is None:
            left += s.max_tokens - len(s.generated)
        forks = len(s.kept) + len(s.segments) if s.keep_contexts else 0
        return pool, pool.pages_for(s.seq["length"] + left) + forks - s.held

    def release(self, state: LoopState) -> None:
        """Return the context's pages to the pool (on finish, and when the request is cancelled or fails)."""
        pool, s = self.instance.kv_pool, ChatState.of(state)
        self.instance.prefilling.discard(state.request_id)
        pool.unreserve(s.held)
        s.held = 0
        if s.seq:
            pool.release(KVSeq(**s.seq))
            s.seq = None
        for kept in s.kept:
            pool.release(KVSeq(**kept["seq"]))
        s.kept = []

    def next(self, state: LoopState) -> WorkPlan | Done:
        s = ChatState.of(state)
        if s.wait:  # waiting for a shared prefix another request prefills: idle, or start from the cache
            if self._waiting(state, s):
                return wait_plan(s.waited)
            self._start(state, s, first=False)
        if s.segments:
            if not self._fuses(s):
                return self._segment_plan(self._ctx(s), s.segments[0], state)
            prompt = s.segments[0]
            plan = self._segment_plan(self._ctx(s), {**prompt, "ids": [*prompt["ids"], s.token]}, state)
            plan.emits = ("progress", "partial")
            plan.label += " (and the first token)"
            return plan
        if s.stop_reason is not None:
            return Done(s.stop_reason)
        inst, ctx = self.instance, self._ctx(s)
        dev = inst.device
        draft = self._draft(s)
        ids = torch.tensor([[s.token, *draft]], device=dev)
        pos = ctx["rope"] + torch.arange(ids.shape[1], device=dev)[None]
        inputs = plan_inputs([ctx], ids=ids, pos=pos)
        return WorkPlan(
            kind=WorkUnitKind.AR_TOKEN,
            body=partial(bodies.token_body, self._net(state), inst.exact),
            inputs=inputs,
            # any context lengths and drafts share a call: padded to the longest (causal: a row's tokens
            # never see its padding)
            batch_key=self._key(state, "ar_decode", ()),
            ragged={"ids": 1, "pos": 1, **RAGGED_CONTEXT},
            emits=("progress", "partial"),
            label=f"token {len(s.generated) + 1}" + (f" (+{len(draft)} drafted)" if draft else ""),
        )

    def _draft(self, s: ChatState) -> list[int]:
        """The tokens drafted after ``s.token`` (prompt lookup over the context; none when off)."""
        k = min(s.speculative_k, s.max_tokens - len(s.generated) - 1)
        if k <= 0:
            return []
        return lookup_draft([*s.keys, s.token], s.speculative_ngram, k)

    def advance(self, state: LoopState, result: StepResult) -> LoopState:
        out, s = result.outputs, ChatState.of(state)
        if s.wait:
            s.waited += 1
            return state
        if s.segments:
            first = self._fuses(s)
            segment = s.segments.pop(0)
            if first:  # the prompt and the first token step's input, <|im_start|>, in one block
                segment = {**segment, "ids": [*segment["ids"], s.token]}
            keys = self._keys(state, segment)
            assert keys is not None, "chat's segments are texts and images"
            advance = len(segment["ids"]) if segment["kind"] == "text" else 1
            self._append(s, *written(out, segment), advance, keys)
            self._remember(state, s.keys, s.seq)  # later requests starting alike reuse these pages
            if not s.segments:
                s.decode_start = time.perf_counter()
                self.instance.prefilling.discard(state.request_id)
            if s.keep_contexts:  # a later stage reuses the context after each segment
                assert s.seq is not None
                fork = self.instance.kv_pool.fork(KVSeq(**s.seq))
                # with the net version that wrote it: only a stage on that version may read it
                s.kept.append({"seq": plain(fork), "rope": s.rope, "net": pinned(state, "net")})
            if first:
                self._first_token(state, s, out["logits"][0].float(), result)
            return state
        assert state.generator is not None, "init seeds the request's generator"
        if state.step == 0:
            s.prompt_tokens = s.seq["length"] if s.seq else 0
        draft, logits = self._draft(s), out["logits"][0].float()
        fed, tokens = [s.token, *draft], []
        for i in range(len(fed)):  # in order, as one token a step would sample them
            token = sample(logits[i], state.generator, s.temperature, s.top_p, s.top_k)
            tokens.append(token)
            self._take(s, token)
            if s.stop_reason is not None or i == len(draft) or token != draft[i]:
                break
            s.accepted += 1
        s.drafted += len(draft)
        n = len(tokens)  # the fed tokens whose keys/values one token a step would have written
        self._append(s, out["k"][0][..., :n, :], out["v"][0][..., :n, :], n, fed[:n])
        state.step += 1
        # the step's stream payload (its "partial" event): the tokens and the text they settled; the
        # logits and keys/values are dropped so a stream consumer holds no cache
        result.outputs = {"token": tokens[-1], "tokens": tokens, "delta": self._delta(s)}
        return state

    @staticmethod
    def _fuses(s: ChatState) -> bool:
        """Whether the next prefill is the prompt's, run with the first token step (a chat's last segment; a
        think-t2i context ends at the prompt, so its thinking starts with a token step of its own)."""
        return len(s.segments) == 1 and s.segments[0]["kind"] == "text" and not s.keep_contexts

    def _first_token(self, state: LoopState, s: ChatState, logits: torch.Tensor, result: StepResult) -> None:
        """Sample the first token from the logits after the prompt's block (as its token step would)."""
        assert state.generator is not None, "init seeds the request's generator"
        assert s.seq is not None
        s.prompt_tokens = s.seq["length"] - 1  # <|im_start|> is the answer's
        token = sample(logits, state.generator, s.temperature, s.top_p, s.top_k)
        self._take(s, token)
        state.step += 1
        result.outputs = {"token": token, "tokens": [token], "delta": self._delta(s)}

    @staticmethod
    def _delta(s: ChatState) -> str:
        """Text not streamed yet that can no longer change: held back while it may be the start of a stop
        string or ends in an incomplete character; all of it once the loop stops."""
        text, sent = s.text, s.streamed
        end = len(text)
        if s.stop_reason is None:
            while end > sent and text[end - 1] == "\ufffd":
                end -= 1
            held = max((n for t in s.stop for n in range(1, len(t)) if text[:end].endswith(t[:n])), default=0)
            end = max(sent, end - held)
        s.streamed = end
        return text[sent:end]

    def _take(self, s: ChatState, token: int) -> None:
        """Fold one sampled token: EOS, then stop strings, then max_tokens."""
        inst = self.instance
        if token == inst.special["eos_token_id"]:
            s.stop_reason = "eos"
            return
        s.generated.append(token)
        s.token = token
        text = inst.tokenizer.decode(s.generated)
        hits = [i for t in s.stop if (i := text.find(t)) >= 0]
        if hits:
            s.text, s.stop_reason = text[: min(hits)], "stop"
            return
        s.text = text
        if len(s.generated) >= s.max_tokens:
            s.stop_reason = "max_tokens"

    def finalize(self, state: LoopState) -> LoopResult:
        s = ChatState.of(state)
        assert s.seq is not None
        context = s.seq["length"]
        outputs: dict[str, Any] = {"text": s.text, "tokens": torch.tensor(s.generated, dtype=torch.long)}
        if s.keep_contexts:  # the next stage owns these pages now
            outputs["contexts"], s.kept = s.kept, []
        self._remember(state, s.keys, s.seq)  # the next turn of the conversation starts from it
        self.release(state)
        seconds = time.perf_counter() - s.decode_start if s.decode_start is not None else 0.0
        metrics: dict[str, Any] = {
            "steps": state.step,
            "stop_reason": s.stop_reason,
            "completion_tokens": len(s.generated),
            "prompt_tokens": s.prompt_tokens if state.step else context,
            "cached_prompt_tokens": s.reused,  # served by the prefix cache, not prefilled
            "decode_tokens_per_s": len(s.generated) / seconds if seconds > 0 else 0.0,
        }
        if s.speculative_k:
            metrics["speculative"] = {
                "drafted": s.drafted,
                "accepted": s.accepted,
                "acceptance": s.accepted / s.drafted if s.drafted else 0.0,
                "tokens_per_step": len(s.generated) / state.step if state.step else 0.0,
            }
        return LoopResult(outputs=outputs, metrics=metrics)


def sample(
    logits: torch.Tensor, generator: torch.Generator, temperature: float, top_p: float, top_k: int
) -> int:
    """One token from ``logits`` ``[V]``: greedy at temperature 0, else top-k, then top-p, then a draw."""
    if temperature <= 0.0:
        return int(torch.argmax(logits))
    logits = logits.cpu() / temperature
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        order = torch.argsort(logits, descending=True)
        probs = torch.softmax(logits[order], dim=-1)
        drop = probs.cumsum(0) - probs > top_p  # keep the smallest prefix whose mass reaches top_p
        logits[order[drop]] = float("-inf")
    return int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))


def lookup_draft(history: list[Any], ngram: int, k: int) -> list[int]:
    """Prompt lookup: the up to ``k`` text tokens that followed the latest earlier occurrence of the last
    ``ngram`` (then fewer) tokens of ``history``; none when no n-gram recurs."""
    for n in range(min(ngram, len(history) - 1), 0, -1):
        tail = history[-n:]
        for start in range(len(history) - n - 1, -1, -1):
            if history[start : start + n] == tail:
                follow = []
                for key in history[start + n : start + n + k]:
                    if not isinstance(key, int):  # an image's token: nothing to draft
                        break
                    follow.append(key)
                if follow:
                    return follow
    return []


def merged(segments: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``segments`` with each run of consecutive texts joined into one (their tokens in order)."""
    out: list[dict[str, Any]] = []
    for segment in segments:
        if segment["kind"] == "text" and out and out[-1]["kind"] == "text":
            out[-1] = {"kind": "text", "ids": [*out[-1]["ids"], *segment["ids"]]}
        else:
            out.append(segment)
    return out
