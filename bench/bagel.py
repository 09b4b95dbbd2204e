"""fv-bagel: one resident BAGEL MoT serving chat and t2i, on a medium random-weight checkpoint (CPU).

Usage: python bench/bagel.py [--repeats 3] [--threads 1] [--out PATH] [--smoke] [--only SECTION,...]

The checkpoint is written in BAGEL-7B-MoT's published layout (bfloat16 ``ema.safetensors``) by
``fv_bagel.tiny.write_checkpoint`` at a medium size (``--smoke``: the tiny sizes) and loaded as
the ``bagel-7b-mot`` card (SDPA math, its default bfloat16). Weights are random: speed and memory only.

- Tokens/s: 8 greedy chat requests with prompts of different lengths (ragged token steps), all
  with the same ``max_tokens``, run one at a time (``Engine.run_serial``), 1 alone and 8 concurrent
  (``Engine.run_batched``, batching on). Every run's token ids are compared with the serial ones, and
  the same 8 interleaved step by step without batching (the interleave gate: bit for bit).
  Prompts whose greedy answer hits EOS early are skipped, so every request decodes ``max_tokens``.
  Also 8 copies of one prompt (equal lengths: every token step one call of 8 rows): the ceiling.
- Denoise step: t2i with the card's CFG (text CFG 4 in its interval: 2 rows a step, else 1),
  seconds per step as the engine measured them, split by rows.
- Prefix caching: 8 concurrent chats that share a ~200-token system prompt (a first turn), each with its
  own question: time to first token and tokens/s with the prefix cache off (every request prefills the
  whole context), on (one earlier request with the same system prompt warmed it) and on with a cold cache
  (the 8 arrive together: one prefills the system prompt, the others wait for it), the prefill tokens
  each ran and their linear-layer FLOPs (2 x the understanding path's parameters per token; attention
  not counted); the tokens of both runs are compared.
- Multi-turn: a conversation's first turn (cold cache) and its second (the first turn and its answer as
  parts): time to first token of each.
- Speculative decoding: a thinking chat (``think``, BAGEL's thinking system prompt) with and without
  prompt-lookup drafts (``speculative_k``), equal output checked: tokens/s and acceptance. On random
  weights nothing recurs (acceptance 0); so also on echo weights (``echo_model``: the same network and
  FLOPs, an LM head that makes greedy output repeat the prompt's text), where prompt lookup applies.
- Memory: peak RSS of subprocesses, each serving one chat and one t2i request concurrently: one
  resident instance, vs two copies (a chat-only one and a t2i one, the second loaded from a copy
  of the folder so no page is shared). safetensors maps the file lazily, so each copy reads all its
  loaded weights once first, as a copy onto a device would; the RSS after imports is reported too.

Times: min and median over ``--repeats``, cases interleaved each repeat (the machine is shared).
Writes JSON and a PNG next to it (``--smoke``: into the temp folder unless ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from wan_vs_diffusers import peak_rss_mib, rss_mib  # noqa: E402

CARD = "bagel-7b-mot"
CONCURRENT = 8
MEDIUM_LLM = dict(
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=12,
    num_attention_heads=16,
    num_key_value_heads=4,
)
# the memory comparison's model: weights (2.9 GB in bf16) well above the ~0.4 GB the imports take
LARGE_LLM = {**MEDIUM_LLM, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 16}
SIZES: dict[str, dict[str, Any]] = {  # checkpoint, chat tokens, t2i side (px) and steps, memory case's size
    "medium": dict(checkpoint=dict(llm=MEDIUM_LLM, max_latent_size=16), max_tokens=32, side=256, steps=10,
                   memory="large", reuse_tokens=8, think_tokens=64),
    "large": dict(checkpoint=dict(llm=LARGE_LLM, max_latent_size=16), max_tokens=8, side=128, steps=3),
    "tiny": dict(checkpoint={}, max_tokens=8, side=64, steps=4, memory="tiny", reuse_tokens=4, think_tokens=16),
}  # fmt: skip
THINK_PROMPT = "draw a red cat on a table, step by step"
MEMORY_STEPS = 3  # t2i steps in the memory runs (peak memory does not grow with steps)
PROMPTS = [  # candidates, short to long; the first 8 whose greedy answer runs to max_tokens are used
    "hello",
    "a red cat",
    "what is in this picture?",
    "describe the image in detail",
    "hello, how are you today? I am fine.",
    "the blue car drives along the river under a cloudy sky",
    "think about the plan first, then draw the scene step by step, please",
    "an astronaut rides a horse on the moon, cinematic, detailed, golden light, wide shot",
    "a photo of a red cat sitting on a wooden table in the morning light, what is it doing?",
    "what is in this picture? there is a small dog and a green tree and a blue car by the river",
    "hi",
    "a dog",
    "tell me a story",
    "what time is it in the morning?",
    "describe the scene: a boat on the lake at sunset with mountains behind it and birds above",
    "let us talk about the weather",
]


class StepLog:
    """Observer: each step's kind, rows (CFG branches), how many plans shared its call, and seconds."""

    def __init__(self) -> None:
        self.steps: list[tuple[str, int, int, float]] = []

    def on_start(self, state: Any, request: Any) -> None:
        return None

    def on_step(self, state: Any, plan: Any, result: Any) -> None:
        self.steps.append((plan.kind.value, plan.batch_size, result.batched_with, result.seconds))

    def on_finish(self, state: Any, result: Any) -> None:
        return None


def stats(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values)}


def timed(fn: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def load(folder: Path, host: Any) -> Any:
    import fv_core

    return fv_core.load(CARD, folder, host=host)


def chat_jobs(model: Any, prompts: list[str], max_tokens: int, tag: str) -> list:
    params = [{"prompt": p, "max_tokens": max_tokens, "temperature": 0.0} for p in prompts]
    return [model.job(model.prepare(p, task="chat", request_id=f"{tag}{i}")) for i, p in enumerate(params)]


def t2i_job(model: Any, side: int, steps: int, tag: str = "image") -> Any:
    params = {
        "prompt": "a red cat on a wooden table",
        "height": side,
        "width": side,
        "num_inference_steps": steps,
    }
    return model.job(model.prepare(params, task="t2i", request_id=tag))


def pick_prompts(model: Any, max_tokens: int) -> list[str]:
    """The first 8 candidates whose greedy answer runs to ``max_tokens`` (random weights may emit EOS)."""
    from fv_core.runtime import Engine

    picked: list[str] = []
    for prompt in PROMPTS:
        [result] = Engine().run_serial(chat_jobs(model, [prompt], max_tokens, "pick"))
        if result is not None and result.metrics["stop_reason"] == "max_tokens":
            picked.append(prompt)
        if len(picked) == CONCURRENT:
            return picked
    sys.exit(
        f"only {len(picked)} of {len(PROMPTS)} prompts decode {max_tokens} tokens without EOS; add prompts"
    )


def token_ids(results: list) -> list[list[int]]:
    return [r.outputs["tokens"].tolist() for r in results]


def tokens_bench(model: Any, prompts: list[str], max_tokens: int, repeats: int) -> dict:
    """Tokens/s one request at a time, 1 alone, 8 concurrent (ragged) and 8 of one prompt (uniform)."""
    from fv_core.runtime import Engine

    ragged = chat_jobs(model, prompts, max_tokens, "r")
    uniform = chat_jobs(model, [prompts[0]] * CONCURRENT, max_tokens, "u")
    cases = {
        "serial": lambda e: e.run_serial(ragged),
        "concurrent_1": lambda e: e.run_batched(ragged[:1]),
        "concurrent_8": lambda e: e.run_batched(ragged),
        "concurrent_8_uniform": lambda e: e.run_batched(uniform),
    }
    Engine().run_batched(ragged)  # warm-up
    rates: dict[str, list[float]] = {name: [] for name in cases}
    outputs: dict[str, list[list[list[int]]]] = {name: [] for name in cases}
    logs: dict[str, StepLog] = {}
    early = dict.fromkeys(cases, 0)
    for _ in range(repeats):
        for name, case in cases.items():
            logs[name] = StepLog()
            engine = Engine(max_batch_rows=CONCURRENT, observers=[logs[name]])
            seconds, results = timed(lambda: case(engine))  # noqa: B023
            # serial runs decode max_tokens (pick_prompts); a batched run's bf16 rounding may flip a
            # greedy token into EOS: its rate counts the tokens it did decode, and the stop is reported
            early[name] += sum(r.metrics["stop_reason"] != "max_tokens" for r in results)
            rates[name].append(sum(r.metrics["completion_tokens"] for r in results) / seconds)
            outputs[name].append(token_ids(results))
    summary = {name: {"tokens_per_s": stats(r)} for name, r in rates.items()}
    for name in ("concurrent_8", "concurrent_8_uniform"):
        summary[name]["token_calls"] = calls_by_rows(logs[name])
    ratio = statistics.median(rates["concurrent_8"]) / statistics.median(rates["serial"])
    uniform_ratio = statistics.median(rates["concurrent_8_uniform"]) / statistics.median(rates["serial"])
    return {
        **summary,
        "tokens_per_request": max_tokens,
        "requests_stopped_early_by_eos": early,  # over all repeats (tokens/s counts the tokens decoded)
        "prompt_tokens": [len(model.instance.tokenizer.encode(p)) for p in prompts],
        "ratio_concurrent_8_vs_serial": ratio,
        "ratio_concurrent_8_uniform_vs_serial": uniform_ratio,
        "goal": ">= 6 (concurrent_8 vs serial)",
        "met": ratio >= 6,
        "interleave_gate": gate(outputs, Engine().run_interleaved(ragged)),
        "notes": batching_notes(summary, max_tokens, uniform_ratio),
    }


def batching_notes(summary: dict, max_tokens: int, uniform_ratio: float) -> str:
    calls = summary["concurrent_8"]["token_calls"]
    per_tick = sum(calls["by_rows"].values()) / max_tokens
    return (
        f"ragged: {calls['mean_rows']:.1f} rows per token call, {per_tick:.1f} calls per tick: token steps and "
        "prompt prefills of any lengths share a call, each row padded to the longest (WorkPlan.ragged); 8 "
        f"equal-length requests: {uniform_ratio:.2f}x serial (no padding, shorter prompts)."
    )


def gate(outputs: dict[str, list[list[list[int]]]], interleaved: list) -> dict:
    """Token ids of every run vs the first serial run's."""
    serial = outputs["serial"][0]
    first_diff = [
        [None if x == y else next((i for i, (a, b) in enumerate(zip(x, y, strict=False)) if a != b), min(len(x), len(y)))
         for x, y in zip(run, serial, strict=True)]
        for run in outputs["concurrent_8"]
    ]  # fmt: skip
    return {
        "interleaved_equals_serial": token_ids(interleaved) == serial,  # the gate: step by step, no batching
        "concurrent_8_equals_serial": all(ids == serial for ids in outputs["concurrent_8"]),
        "concurrent_8_first_differing_token": first_diff,  # per repeat, per request (null: equal)
        "concurrent_1_equals_serial": all(ids == serial[:1] for ids in outputs["concurrent_1"]),
        "uniform_equals_serial": all(
            ids == [serial[0]] * CONCURRENT for ids in outputs["concurrent_8_uniform"]
        ),
        "note": "interleaving must be bit for bit (the gate); a batched step multiplies more rows at once "
        "and attends over padded contexts, so its bfloat16 results differ from a solo step's by rounding, "
        "which can flip a greedy argmax (the card promises batched == solo only within its tolerance)",
    }


def calls_by_rows(log: StepLog) -> dict[str, Any]:
    """Token step calls of the last run by rows per call (a call of n rows logs n plans), and the mean."""
    counts = Counter(shared for kind, _, shared, _ in log.steps if kind == "ar_token")
    calls = {rows: n / rows for rows, n in sorted(counts.items())}
    mean = sum(rows * n for rows, n in calls.items()) / sum(calls.values())
    return {"by_rows": {str(rows): n for rows, n in calls.items()}, "mean_rows": mean}


def denoise_bench(model: Any, side: int, steps: int, repeats: int) -> dict:
    """Seconds per denoise step (split by CFG rows) and per t2i request."""
    from fv_core.runtime import Engine

    Engine().run_one(*t2i_job(model, side, 2))  # warm-up (loads the VAE)
    per_rows: dict[int, list[float]] = {}
    walls = []
    for _ in range(repeats):
        log = StepLog()
        walls.append(timed(lambda: Engine(observers=[log]).run_one(*t2i_job(model, side, steps)))[0])  # noqa: B023
        for kind, rows, _, seconds in log.steps:
            if kind == "diffusion_step":
                per_rows.setdefault(rows, []).append(seconds)
    return {
        "height": side,
        "width": side,
        "latent_tokens": (side // 16) ** 2,
        "num_inference_steps": steps,
        "step_s_by_cfg_rows": {str(r): {**stats(s), "steps": len(s)} for r, s in sorted(per_rows.items())},
        "request_s": stats(walls),
        "cfg": "the card's: text CFG 4.0 for t in (0.4, 1] (rows cond + text_uncond), the conditional alone after",
    }


# ---- prefix caching and speculative decoding ----


def first_token_times(model: Any, engine_cls: Any, items: list, start: float) -> tuple[list[float], list]:
    """Run ``items`` batched; each request's seconds from ``start`` to its first token, and the results."""
    first: dict[str, float] = {}

    def seen(event: Any) -> None:
        if event.kind == "partial" and event.request_id not in first:
            first[event.request_id] = time.perf_counter() - start

    results = engine_cls(max_batch_rows=CONCURRENT, on_event=seen).run_batched(items)
    return [first[item[1].request_id] for item in items], results


def system_prompt(model: Any, tokens: int) -> str:
    """A system prompt of about ``tokens`` tokens."""
    words = "you are a careful assistant who looks at pictures and answers in short clear sentences".split()
    text = ""
    i = 0
    while len(model.instance.tokenizer.encode(text)) < tokens:
        text += ("" if not text else " ") + words[i % len(words)]
        i += 1
    return text


def chat_items(model: Any, parts: list, prompts: list[str], max_tokens: int, tag: str, **extra: Any) -> list:
    params = [{"prompt": p, "max_tokens": max_tokens, "temperature": 0.0, **extra} for p in prompts]
    return [
        model.job(model.prepare(p, task="chat", parts=parts, request_id=f"{tag}{i}"))
        for i, p in enumerate(params)
    ]


def understanding_params(model: Any) -> int:
    """Parameters a text token runs through (the understanding expert's layers and the LM head)."""
    lm = model.instance.net.language_model
    return sum(p.numel() for n, p in lm.named_parameters() if "_moe_gen" not in n and "embed_tokens" not in n)


def prefix_bench(model: Any, prompts: list[str], max_tokens: int, repeats: int) -> dict:
    """8 concurrent chats sharing a 200-token system prompt, prefix cache off vs on (warmed)."""
    from fv_core import TextPart
    from fv_core.runtime import Engine

    inst = model.instance
    system = [TextPart(system_prompt(model, 200))]
    cases: dict[str, dict[str, list]] = {"off": {}, "on": {}, "together": {}}
    for r in range(repeats):
        for case in cases:
            inst.kv_pool.drain()
            inst.prefix_caching = case != "off"
            if case == "on":  # an earlier request with the same system prompt
                Engine().run_serial(chat_items(model, system, ["hello"], 1, f"warm{r}"))
            items = chat_items(model, system, prompts, max_tokens, f"p{case}{r}")
            start = time.perf_counter()
            ttft, results = first_token_times(model, Engine, items, start)
            seconds = time.perf_counter() - start
            out = cases[case]
            out.setdefault("ttft_s", []).extend(ttft)
            out.setdefault("ttft_median_s", []).append(statistics.median(ttft))
            out.setdefault("tokens_per_s", []).append(
                sum(x.metrics["completion_tokens"] for x in results) / seconds
            )
            out["prefill_tokens"] = sum(
                x.metrics["prompt_tokens"] - x.metrics["cached_prompt_tokens"] for x in results
            )
            out["cached_prompt_tokens"] = [x.metrics["cached_prompt_tokens"] for x in results]
            out["tokens"] = token_ids(results)
    inst.prefix_caching = True
    per_token = 2 * understanding_params(model)
    off, on, together = cases["off"], cases["on"], cases["together"]
    ratio = statistics.median(on["ttft_median_s"]) / statistics.median(off["ttft_median_s"])
    return {
        "system_prompt_tokens": len(inst.tokenizer.encode(system[0].text)) + 2,
        "concurrent": CONCURRENT,
        "max_tokens": max_tokens,
        **{
            f"cache_{name}": {
                "ttft_s": stats(c["ttft_median_s"]),  # per run: the median over its 8 requests
                "ttft_s_all_requests": stats(c["ttft_s"]),
                "tokens_per_s": stats(c["tokens_per_s"]),
                "prefill_tokens": c["prefill_tokens"],
                "prefill_linear_flops": c["prefill_tokens"] * per_token,
                "cached_prompt_tokens": c["cached_prompt_tokens"],
            }
            for name, c in cases.items()
        },
        "ttft_ratio_on_vs_off": ratio,
        "tokens_per_s_ratio_on_vs_off": statistics.median(on["tokens_per_s"])
        / statistics.median(off["tokens_per_s"]),
        "prefill_flops_saved": (off["prefill_tokens"] - on["prefill_tokens"]) * per_token,
        "prefill_flops_saved_fraction": 1 - on["prefill_tokens"] / off["prefill_tokens"],
        "ttft_ratio_together_vs_off": statistics.median(together["ttft_median_s"])
        / statistics.median(off["ttft_median_s"]),
        "prefill_flops_saved_fraction_together": 1 - together["prefill_tokens"] / off["prefill_tokens"],
        "outputs_equal": on["tokens"] == off["tokens"],
        "outputs_equal_together": together["tokens"] == off["tokens"],
        "note": "cache_on: an earlier request warmed the cache; cache_together: a cold cache, the 8 arrive at "
        "once and the first one's prefill of the system prompt serves the other 7 (they wait for it)",
        "goal": "ttft_ratio_on_vs_off <= 0.5",
        "met": ratio <= 0.5,
    }


def multi_turn_bench(model: Any, max_tokens: int, repeats: int) -> dict:
    """A conversation's first turn (cold) and second turn (the first and its answer as parts): TTFT."""
    from fv_core import TextPart
    from fv_core.runtime import Engine

    inst = model.instance
    system = TextPart(system_prompt(model, 200))
    first_s, second_s, cached = [], [], []
    for r in range(repeats):
        inst.kv_pool.drain()
        items = chat_items(model, [system], ["what is in the picture?"], max_tokens, f"t1_{r}")
        (t1,), _ = first_token_times(model, Engine, items, time.perf_counter())
        first_s.append(t1)
    # the answer of the first turn (greedy: the same every repeat)
    inst.kv_pool.drain()
    [answer] = Engine().run_serial(chat_items(model, [system], ["what is in the picture?"], max_tokens, "a"))
    talk = [system, TextPart("what is in the picture?"), TextPart(answer.outputs["text"])]
    for r in range(repeats):
        inst.kv_pool.drain()
        Engine().run_serial(chat_items(model, [system], ["what is in the picture?"], max_tokens, f"w{r}"))
        items = chat_items(model, talk, ["and what colour is it?"], max_tokens, f"t2_{r}")
        (t2,), results = first_token_times(model, Engine, items, time.perf_counter())
        second_s.append(t2)
        cached.append((results[0].metrics["cached_prompt_tokens"], results[0].metrics["prompt_tokens"]))
    ratio = statistics.median(second_s) / statistics.median(first_s)
    return {
        "first_turn_ttft_s": stats(first_s),
        "second_turn_ttft_s": stats(second_s),
        "second_turn_cached_of_prompt_tokens": cached[-1],
        "ratio": ratio,
        "goal": "second turn TTFT <= 0.3x the first",
        "met": ratio <= 0.3,
    }


def echo_text(model: Any, tokens: int = 48) -> str:
    """A text of ``tokens`` distinct tokens that tokenizes back to them (the echo weights' text)."""
    tok, special = model.instance.tokenizer, set(model.instance.special.values())
    ids: list[int] = []
    for token in range(len(tok)):
        trial = [*ids, token]
        if token not in special and tok.encode(tok.decode(trial)) == trial:
            ids = trial
        if len(ids) == tokens:
            break
    return tok.decode(ids)


def echo_model(folder: Path, model: Any, host: Any, text: str) -> Any:
    """The checkpoint with weights that continue ``text`` (a copy of ``folder``): every layer's attention
    and MLP outputs scaled by 1e-3 (the same FLOPs, a residual stream that stays near the token's embedding)
    and an LM head whose row for each token of the text is the embedding of the token before it (the last
    wraps to the first): greedy decoding then writes the text over and over, a workload prompt lookup can
    draft. The drafts are still verified by the model, token by token."""
    import torch
    from safetensors.torch import load_file, save_file

    out = folder.with_name(folder.name + "-echo")
    shutil.copytree(folder, out, ignore=shutil.ignore_patterns("ema.safetensors"))
    weights = load_file(folder / "ema.safetensors")
    for name, value in weights.items():
        if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            weights[name] = value * 1e-3
    embed = weights["language_model.model.embed_tokens.weight"].float()
    head = torch.zeros_like(embed)
    ids = model.instance.tokenizer.encode(text)
    for before, token in zip(ids, ids[1:] + ids[:1], strict=True):
        head[token] = embed[before] / embed[before].norm() * 8
    weights["language_model.lm_head.weight"] = head.to(weights["language_model.lm_head.weight"].dtype)
    save_file(weights, out / "ema.safetensors", metadata={"format": "pt"})
    return load(out, host)


def speculative_bench(model: Any, max_tokens: int, repeats: int, prompt: str = THINK_PROMPT) -> dict:
    """A thinking chat, one token a step vs prompt-lookup drafts: tokens/s at equal output, acceptance."""
    from fv_core.runtime import Engine

    cases = {"plain": {}, "speculative": {"speculative_k": 4, "speculative_ngram": 3}}
    rates: dict[str, list[float]] = {n: [] for n in cases}
    outs: dict[str, list] = {}
    metrics: dict[str, dict] = {}
    for r in range(repeats):
        for name, extra in cases.items():
            items = chat_items(
                model,
                [],
                [prompt],
                max_tokens,
                f"s{name}{r}",
                think=True,
                **extra,
            )
            seconds, [result] = timed(lambda: Engine().run_serial(items))  # noqa: B023
            rates[name].append(result.metrics["completion_tokens"] / seconds)
            outs[name] = result.outputs["tokens"].tolist()
            metrics[name] = result.metrics
    ratio = statistics.median(rates["speculative"]) / statistics.median(rates["plain"])
    return {
        "max_tokens": max_tokens,
        "tokens": len(outs["plain"]),
        "tokens_per_s": {n: stats(v) for n, v in rates.items()},
        "ratio": ratio,
        "outputs_equal": outs["plain"] == outs["speculative"],
        "first_differing_token": next(
            (i for i, (a, b) in enumerate(zip(outs["plain"], outs["speculative"], strict=False)) if a != b),
            None,
        ),
        "speculative": metrics["speculative"].get("speculative"),
        "decode_tokens_per_s_metric": {n: m["decode_tokens_per_s"] for n, m in metrics.items()},
        "goal": ">= 1.5x at equal output",
        "met": ratio >= 1.5,
    }


# ---- memory: one subprocess per case ----


def memory_child(case: str, folder: str, copy_folder: str, size: str) -> dict:
    """Serve one chat and one t2i request concurrently: on one instance, or on two copies."""
    from diffusers import AutoencoderKL  # noqa: F401  (what the requests import, before the baseline)
    from transformers import AutoTokenizer  # noqa: F401

    import fv_bagel.chat_loop  # noqa: F401
    import fv_bagel.t2i_loop  # noqa: F401
    from fv_core.plugins import load_plugins
    from fv_core.runtime import Engine

    host = load_plugins(env={"FV_PLUGINS": "fv-bagel"})
    baseline = rss_mib()
    chat_model = load(Path(folder), host)
    image_model = chat_model if case == "one_instance" else load(Path(copy_folder), host)
    weights = resident(chat_model, ("net", "tokenizer"))
    if image_model is not chat_model:
        weights += resident(image_model, ("net", "tokenizer", "vae"))
    else:
        weights += resident(image_model, ("vae",))
    s = SIZES[size]
    items = [
        *chat_jobs(chat_model, [PROMPTS[0]], s["max_tokens"], "m"),
        t2i_job(image_model, s["side"], MEMORY_STEPS),
    ]
    config = chat_model.instance.net.language_model.config
    loaded = rss_mib()
    Engine().run_batched(items)
    return {
        "baseline_mib": baseline,  # after imports
        "loaded_mib": loaded,  # the weights read once, before any request
        "peak_mib": peak_rss_mib(),
        "weights_mib": weights / (1 << 20),  # the loaded components' parameters and buffers
        "generation_expert_mib": generation_bytes(chat_model) / (1 << 20),  # of one copy's net
        "llm": {k: getattr(config, k) for k in MEDIUM_LLM},
        "params": sum(p.numel() for p in chat_model.instance.net.parameters()),
    }


def generation_bytes(model: Any) -> int:
    """Bytes of the net's generation-only weights: the ``_moe_gen`` expert and the latent heads."""
    heads = ("time_embedder.", "vae2llm.", "llm2vae.", "latent_pos_embed.")
    net = model.instance.net
    return sum(
        p.numel() * p.element_size()
        for n, p in net.named_parameters()
        if "_moe_gen" in n or n.startswith(heads)
    )


def resident(model: Any, names: tuple[str, ...]) -> int:
    """Load ``names`` and read every tensor once (mapped file pages become resident); returns their bytes."""
    import torch

    total = 0
    for name in names:
        component = model.instance.component(name)
        if isinstance(component, torch.nn.Module):
            for t in (*component.parameters(), *component.buffers()):
                t.detach().float().sum()
                total += t.numel() * t.element_size()
    return total


def memory_bench(folder: Path, size: str, threads: int) -> dict:
    copy_folder = folder.with_name(folder.name + "-copy")
    shutil.copytree(folder, copy_folder)
    runs = {}
    for case in ("one_instance", "two_copies"):
        cmd = [sys.executable, __file__, "--child", case, "--folder", str(folder), "--copy", str(copy_folder)]
        cmd += ["--size", size, "--threads", str(threads)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"memory case {case} failed:\n{done.stderr[-4000:]}")
        runs[case] = json.loads(done.stdout.strip().splitlines()[-1])
    one, two = runs["one_instance"], runs["two_copies"]
    ratio = one["peak_mib"] / two["peak_mib"]
    net_ratio = (one["peak_mib"] - one["baseline_mib"]) / (two["peak_mib"] - two["baseline_mib"])
    und_only = two["peak_mib"] - two["baseline_mib"] - two["generation_expert_mib"]
    return {
        **runs,
        "ratio": ratio,
        "ratio_minus_baseline": net_ratio,
        # were the chat copy an understanding-only model (no generation expert, no latent heads)
        "ratio_minus_baseline_vs_understanding_only_chat_copy": (one["peak_mib"] - one["baseline_mib"])
        / und_only,
        "goal": "<= 0.55",
        "met": ratio <= 0.55,
        "met_minus_baseline": net_ratio <= 0.55,
        "notes": (
            f"Both processes start from the same RSS after imports (torch, transformers, diffusers, fv: "
            f"{one['baseline_mib']:.0f} MiB); at this size one copy's weights are {one['weights_mib']:.0f} MiB, "
            f"so even a perfect share cannot go below (B + W) / (B + 2W) = "
            f"{(one['baseline_mib'] + one['weights_mib']) / (one['baseline_mib'] + 2 * one['weights_mib']):.2f}. "
            "ratio_minus_baseline compares what the models add over the imports; at BAGEL-7B-MoT's size "
            "(two 7B experts: tens of GB of weights) the baseline is a rounding error and the two ratios meet. "
            "two_copies loads the whole checkpoint twice (the chat copy holds the generation expert too, unused); "
            "ratio_minus_baseline_vs_understanding_only_chat_copy drops that expert from the chat copy."
        ),
    }


# ---- main ----


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: checks the script end to end")
    ap.add_argument("--out", help="JSON path (default bench/results/bagel.json; --smoke: the temp folder)")
    ap.add_argument(
        "--only",
        help="comma-separated sections to rerun (e.g. prefix_caching,multi_turn); the others are kept from the "
        "JSON already at --out, and 'rerun' records which ran when",
    )
    for flag in ("--child", "--folder", "--copy", "--size"):
        ap.add_argument(flag, help=argparse.SUPPRESS)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    if args.child:
        with torch.inference_mode():
            print(json.dumps(memory_child(args.child, args.folder, args.copy, args.size)))
        return
    size = "tiny" if args.smoke else "medium"
    default = (
        Path(tempfile.gettempdir()) / "bagel_smoke.json"
        if args.smoke
        else Path(__file__).parent / "results" / "bagel.json"
    )
    out = Path(args.out) if args.out else default
    only = set(args.only.split(",")) if args.only else None
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        fresh = run(Path(tmp) / f"bagel-{size}", size, args.repeats, args.threads, only)
    machine = {
        "cpu": platform.processor() or platform.machine(),
        "torch_threads": args.threads,
        "repeats": args.repeats,
        "load_avg_1m": os.getloadavg()[0],
    }
    if only is None:
        result = {**fresh, "machine": machine}
    else:  # the sections rerun replace those of the last full run
        result = {**json.loads(out.read_text()), **fresh}
        result.setdefault("rerun", {}).update({name: machine for name in only})
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    plot(out.with_suffix(".png"), result)
    print(json.dumps(result, indent=2))


def run(folder: Path, size: str, repeats: int, threads: int, only: set[str] | None = None) -> dict:
    """Every section, or those named in ``only``."""
    import torch

    from fv_bagel.tiny import write_checkpoint
    from fv_core.plugins import load_plugins
    from fv_core.runtime.engine import freeze_heap

    s = SIZES[size]
    write_checkpoint(folder, **s["checkpoint"], dtype=torch.bfloat16)
    memory_folder = folder.with_name(f"bagel-{s['memory']}")
    if memory_folder != folder:
        write_checkpoint(memory_folder, **SIZES[s["memory"]]["checkpoint"], dtype=torch.bfloat16)
    host = load_plugins(env={"FV_PLUGINS": "fv-bagel"})
    model = load(folder, host)
    wants_prompts = only is None or {"chat", "prefix_caching"} & only
    prompts = pick_prompts(model, s["max_tokens"]) if wants_prompts else []
    freeze_heap()
    net = model.instance.net
    config = net.language_model.config
    sections = {
        "checkpoint": lambda: {
            "card": CARD,
            "size": size,
            "llm": {k: getattr(config, k) for k in (*MEDIUM_LLM, "vocab_size")},
            "max_latent_size": net.max_latent_size,
            "params": sum(p.numel() for p in net.parameters()),
            "precision": model.instance.precision,
            "weights": "random",
        },
        "chat": lambda: tokens_bench(model, prompts, s["max_tokens"], repeats),
        "prefix_caching": lambda: prefix_bench(model, prompts, s["reuse_tokens"], repeats),
        "multi_turn": lambda: multi_turn_bench(model, s["reuse_tokens"], repeats),
        "speculative": lambda: speculative_bench(model, s["think_tokens"], repeats),
        "speculative_echo": lambda: echo_bench(folder, model, host, s["think_tokens"], repeats),
        "denoise": lambda: denoise_bench(model, s["side"], s["steps"], repeats),
        "memory": lambda: memory_bench(memory_folder, s["memory"], threads),
        "peak_rss_mib_this_process": peak_rss_mib,  # the medium model's runs above, all cases
    }
    chosen = {"checkpoint", *(only or sections)}  # a full run's peak RSS counts every case
    return {name: section() for name, section in sections.items() if name in chosen}


def echo_bench(folder: Path, model: Any, host: Any, max_tokens: int, repeats: int) -> dict:
    """Speculative decoding where prompt lookup applies: the echo weights, their text as the prompt."""
    text = echo_text(model)
    result = speculative_bench(echo_model(folder, model, host, text), max_tokens, repeats, prompt=text)
    note = "echo weights (echo_model): greedy output repeats the prompt's text; the same FLOPs a token"
    return {**result, "prompt": text, "weights": note}


def plot(path: Path, r: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, grid = plt.subplots(2, 3, figsize=(14, 7.6))
    axes = grid[0]
    chat = r["chat"]
    names = ["serial", "concurrent_1", "concurrent_8", "concurrent_8_uniform"]
    axes[0].bar(["serial", "1", "8 ragged", "8 uniform"], [chat[n]["tokens_per_s"]["median"] for n in names],
                color=["#999", "#7ab", "#3a7", "#9c9"])  # fmt: skip
    axes[0].set_title(f"chat tokens/s (8 vs serial: {chat['ratio_concurrent_8_vs_serial']:.2f}x, goal 6x)")
    steps = r["denoise"]["step_s_by_cfg_rows"]
    axes[1].bar([f"{rows} row(s)" for rows in steps], [v["median"] for v in steps.values()], color="#3a7")
    axes[1].set_title(f"denoise step s ({r['denoise']['height']}px)")
    mem = r["memory"]
    labels = ["after imports", "one instance", "two copies"]
    values = [
        mem["one_instance"]["baseline_mib"],
        mem["one_instance"]["peak_mib"],
        mem["two_copies"]["peak_mib"],
    ]
    axes[2].bar(labels, values, color=["#ccc", "#3a7", "#999"])
    billions = mem["one_instance"]["params"] / 1e9
    axes[2].set_title(
        f"peak RSS MiB, {billions:.2f}B MoT (ratio {mem['ratio']:.2f}, {mem['ratio_minus_baseline']:.2f} over imports)"
    )
    pc, mt, sp = r["prefix_caching"], r["multi_turn"], r["speculative"]
    cases = [c for c in ("off", "on", "together") if f"cache_{c}" in pc]
    grid[1][0].bar([f"cache {c}" for c in cases], [pc[f"cache_{c}"]["ttft_s"]["median"] for c in cases],
                   color=["#999", "#3a7", "#9c9"][: len(cases)])  # fmt: skip
    grid[1][0].set_title(
        f"8 chats, {pc['system_prompt_tokens']}-token system prompt: TTFT s ({pc['ttft_ratio_on_vs_off']:.2f}x)"
    )
    grid[1][1].bar(["turn 1", "turn 2"], [mt["first_turn_ttft_s"]["median"], mt["second_turn_ttft_s"]["median"]],
                   color=["#999", "#3a7"])  # fmt: skip
    grid[1][1].set_title(f"multi-turn TTFT s ({mt['ratio']:.2f}x, goal 0.3)")
    sp = r.get("speculative_echo", sp)  # where prompt lookup applies (echo weights), when measured
    grid[1][2].bar(["one a step", "prompt lookup"], [sp["tokens_per_s"][n]["median"] for n in ("plain", "speculative")],
                   color=["#999", "#3a7"])  # fmt: skip
    acc = (sp["speculative"] or {}).get("acceptance", 0.0)
    which = "echo weights" if "prompt" in sp else "random weights"
    grid[1][2].set_title(f"thinking tokens/s, {which} ({sp['ratio']:.2f}x, acceptance {acc:.2f})")
    axes = [*grid[0], *grid[1]]
    for ax in axes:
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(
        f"BAGEL MoT {r['checkpoint']['size']} random weights, CPU: one resident instance, chat + t2i"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
