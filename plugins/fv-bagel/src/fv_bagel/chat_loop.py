"""BAGEL's AR decode loop (task ``chat``; the thinking of ``think-t2i``): prefill the conversation's
texts and images and the prompt, then one token per step.

Each token step feeds the last token at the next position and appends its keys/values; sampling
(greedy / temperature / top-k / top-p), EOS, stop strings and ``max_tokens`` run in ``advance`` on the
request's own generator. Token steps of different requests batch as rows whatever their context
lengths (:mod:`fv_bagel.context`). ``kv_need`` tells admission the most pages the request can hold at
once, so a request waits for pages instead of running out of them mid-decode.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from fv_bagel import bodies
from fv_bagel.context import RAGGED_CONTEXT, check_positions, plain, plan_inputs, text_ids, written
from fv_bagel.images import understood
from fv_bagel.prefill import PrefillLoop
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
        ChatState(
            segments=segments,
            token=inst.special["bos_token_id"],  # the first decode step feeds <|im_start|>
            max_tokens=p.max_tokens,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            stop=list(p.stop),
            keep_contexts=bool(request.carry.get("keep_contexts")),
        ).put(state)
        return state

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
        self, s: ChatState, out: dict[str, Any], rope_advance: int, segment: dict[str, Any] | None = None
    ) -> None:
        """Write a block's keys/values after the context (into this request's own pages)."""
        assert s.seq is not None, "released contexts take no more tokens"
        seq = self.instance.kv_pool.append(KVSeq(**s.seq), *written(out, segment))
        s.seq = {"pages": seq.pages, "length": seq.length}
        s.rope += rope_advance

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
        return pool, pool.pages_for(s.seq["length"] + left) + forks

    def release(self, state: LoopState) -> None:
        """Return the context's pages to the pool (on finish, and when the request is cancelled or fails)."""
        pool, s = self.instance.kv_pool, ChatState.of(state)
        if s.seq:
            pool.release(KVSeq(**s.seq))
            s.seq = None
        for kept in s.kept:
            pool.release(KVSeq(**kept["seq"]))
        s.kept = []

    def next(self, state: LoopState) -> WorkPlan | Done:
        s = ChatState.of(state)
        if s.segments:
            return self._segment_plan(self._ctx(s), s.segments[0], state)
        if s.stop_reason is not None:
            return Done(s.stop_reason)
        inst, ctx = self.instance, self._ctx(s)
        dev = inst.device
        ids = torch.tensor([[s.token]], device=dev)
        pos = torch.tensor([[ctx["rope"]]], device=dev)
        inputs = plan_inputs([ctx], ids=ids, pos=pos)
        return WorkPlan(
            kind=WorkUnitKind.AR_TOKEN,
            body=partial(bodies.text_body, self._net(state), inst.exact, True),
            inputs=inputs,
            # any context lengths share a call: padded to the longest
            batch_key=self._key(state, "ar_decode", ()),
            ragged=RAGGED_CONTEXT,
            emits=("progress", "partial"),
            label=f"token {len(s.generated) + 1}",
        )

    def advance(self, state: LoopState, result: StepResult) -> LoopState:
        out, s = result.outputs, ChatState.of(state)
        if s.segments:
            segment = s.segments.pop(0)
            self._append(s, out, len(segment["ids"]) if segment["kind"] == "text" else 1, segment)
            if s.keep_contexts:  # a later stage reuses the context after each segment
                assert s.seq is not None
                fork = self.instance.kv_pool.fork(KVSeq(**s.seq))
                # with the net version that wrote it: only a stage on that version may read it
                s.kept.append({"seq": plain(fork), "rope": s.rope, "net": pinned(state, "net")})
            return state
        self._append(s, out, 1)
        state.step += 1
        assert state.generator is not None, "init seeds the request's generator"
        token = sample(out["logits"][0].float(), state.generator, s.temperature, s.top_p, s.top_k)
        self._take(s, token)
        # the step's stream payload (its "partial" event): the token and the text it settled; the
        # logits and keys/values are dropped so a stream consumer holds no cache
        result.outputs = {"token": token, "delta": self._delta(s)}
        return state

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
        self.release(state)
        return LoopResult(
            outputs=outputs,
            metrics={
                "steps": state.step,
                "stop_reason": s.stop_reason,
                "completion_tokens": len(s.generated),
                "prompt_tokens": context - state.step,
            },
        )


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
