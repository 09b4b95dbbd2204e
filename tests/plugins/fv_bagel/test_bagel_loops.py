"""BAGEL's loops on the tiny card through the front door: chat (AR decode: sampling, EOS, stop strings,
max tokens, images), t2i (denoise with CFG), one resident instance for both, the interleave gate with
chat and t2i mixed, ragged token steps batched across requests, and a golden trajectory."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import fv_bagel.bodies as bagel_loop
import fv_core
from fv_bagel.cards import bagel_7b_mot
from fv_bagel.chat_loop import sample
from fv_bagel.guidance import guide, schedule
from fv_bagel.state import ChatState, DenoiseState
from fv_core import ConfigError, ImageArtifact, ImagePart, TextArtifact, TextPart
from fv_core.kv import KVSeq
from fv_core.loop import StepResult
from fv_core.parity import assert_interleave_parity, check_batched_parity
from fv_core.runtime import Engine

GOLDEN = Path(__file__).with_name("golden_bagel_tiny.json")
PICTURE = ImagePart(np.random.default_rng(0).random((40, 56, 3)).astype(np.float32))


def test_published_defaults_are_the_cards(bagel):
    t2i = bagel_7b_mot().programs["t2i"].defaults
    assert (t2i["num_inference_steps"], t2i["cfg_text_scale"], t2i["cfg_img_scale"]) == (50, 4.0, 1.0)
    assert (t2i["cfg_interval"], t2i["cfg_renorm_type"], t2i["timestep_shift"]) == ((0.4, 1.0), "global", 3.0)
    assert bagel_7b_mot().programs["chat"].defaults["temperature"] == 0.0  # greedy, as published
    p = bagel.prepare({"prompt": "a cat"}, task="t2i").params
    assert (p.height, p.width, p.num_inference_steps) == (64, 64, 8)


@pytest.fixture(scope="module")
def fresh(bagel_host, bagel_path):
    """A second instance of the tiny card (nothing loaded yet)."""
    return fv_core.load("bagel-tiny", bagel_path, host=bagel_host)


def test_chat_is_text_only_and_never_loads_the_vae(fresh):
    model = fresh
    answer = model.generate(task="chat", prompt="hello, how are you?", max_tokens=6)
    assert isinstance(answer, TextArtifact) and answer.provenance["metrics"]["completion_tokens"] <= 6
    assert model.instance.loaded() == ["net", "tokenizer"]
    image = model.generate(task="t2i", prompt="a red cat", num_inference_steps=3)
    assert isinstance(image, ImageArtifact) and image.image.shape == (64, 64, 3)
    assert model.instance.loaded() == ["net", "tokenizer", "vae"]  # the same net served both


def test_chat_with_an_image_prefills_vit_tokens(bagel):
    picture = ImagePart(np.random.default_rng(0).random((40, 56, 3)).astype(np.float32))
    with_image = bagel.generate(task="chat", parts=[picture], prompt="what is this?", max_tokens=4, seed=1)
    without = bagel.generate(task="chat", prompt="what is this?", max_tokens=4, seed=1)
    assert with_image.provenance["metrics"]["prompt_tokens"] > without.provenance["metrics"]["prompt_tokens"]


def test_a_conversation_prefills_its_turns_in_order(bagel):
    """Text parts are the turns before the prompt, each its own span; their order matters."""
    turns = [TextPart("you answer briefly"), TextPart("hello"), PICTURE, TextPart("hi, what is it?")]
    alone = bagel.generate(task="chat", prompt="a cat?", max_tokens=6, temperature=0.9, seed=3)
    talk = bagel.generate(task="chat", parts=turns, prompt="a cat?", max_tokens=6, temperature=0.9, seed=3)
    swapped = turns[:1] + turns[2:3] + turns[1:2] + turns[3:]
    other = bagel.generate(task="chat", parts=swapped, prompt="a cat?", max_tokens=6, temperature=0.9, seed=3)
    tokens = [a.provenance["metrics"]["prompt_tokens"] for a in (alone, talk, other)]
    assert tokens[1] == tokens[2] > tokens[0]
    logits = [bagel_loop_logits(bagel, parts) for parts in (turns, swapped)]
    assert not torch.equal(*logits)


def bagel_loop_logits(bagel, parts) -> torch.Tensor:
    """The first decode step's logits after prefilling ``parts`` and a prompt."""
    request = bagel.prepare({"prompt": "a cat?", "max_tokens": 1}, task="chat", parts=parts)
    loop = bagel.loop("chat")
    with torch.inference_mode():
        state = loop.init(request)
        while ChatState.of(state).segments:
            plan = loop.next(state)
            loop.advance(state, StepResult(outputs=plan.body(plan.inputs)))
        plan = loop.next(state)
        logits = plan.body(plan.inputs)["logits"]
    loop.release(state)
    return logits


def test_sampling_eos_stop_strings_and_max_tokens(bagel):
    greedy = bagel.generate(task="chat", prompt="describe the image", max_tokens=8)
    assert (
        bagel.generate(task="chat", prompt="describe the image", max_tokens=8, top_k=1, temperature=0.7).text
        == greedy.text
    )
    hot = [
        bagel.generate(task="chat", prompt="describe the image", max_tokens=8, temperature=1.5, seed=s).text
        for s in (1, 1, 2)
    ]
    assert hot[0] == hot[1] and hot[0] != hot[2]  # the request's seed, and only it, drives sampling
    assert greedy.provenance["metrics"]["stop_reason"] in ("max_tokens", "eos")
    cut = greedy.text[2:4]
    stopped = bagel.generate(task="chat", prompt="describe the image", max_tokens=8, stop=[cut])
    assert stopped.provenance["metrics"]["stop_reason"] == "stop" and cut not in stopped.text
    logits = torch.tensor([0.0, 5.0, 4.9, -3.0])
    g = torch.Generator().manual_seed(0)
    assert {sample(logits, g, 1.0, 0.5, 0) for _ in range(20)} == {1}  # top-p keeps the head only
    assert {sample(logits, g, 5.0, 1.0, 2) for _ in range(40)} == {1, 2}  # top-k 2
    with pytest.raises(ConfigError, match="stop"):
        bagel.prepare({"prompt": "x", "stop": [""]}, task="chat")
    with pytest.raises(ConfigError, match="multiple of 16"):
        bagel.prepare({"prompt": "x", "height": 40}, task="t2i")


def test_schedule_and_guidance_follow_bagel():
    times, dts = schedule(5, 3.0)
    assert len(times) == 4 and times[0] == 1.0 and abs(sum(dts) - 1.0) < 1e-6
    g = torch.Generator().manual_seed(0)
    v, vt, vi = (torch.randn(6, 8, generator=g) for _ in range(3))
    assert torch.equal(guide(v, None, None, 4.0, 1.0, "global", 0.0), v)
    out = guide(v, vt, None, 4.0, 1.0, "global", 0.0)
    assert torch.norm(out) <= torch.norm(v) * (1 + 1e-6)  # renormed to at most the conditional's norm
    per_token = guide(v, vt, vi, 4.0, 2.0, "channel", 0.0)
    assert (per_token.norm(dim=-1) <= v.norm(dim=-1) * (1 + 1e-6)).all()
    assert guide(v, vt, vi, 4.0, 2.0, "text_channel", 0.0).shape == v.shape


def _mixed(bagel, tasks=("chat", "t2i", "think-t2i", "edit")):
    def items():
        params = [
            ("chat", {"prompt": "hi", "max_tokens": 4}),  # a context of 4 tokens, then 9: one length bucket
            ("t2i", {"prompt": "a red cat", "num_inference_steps": 3, "seed": 3}),
            ("chat", {"prompt": "what is in the picture?", "max_tokens": 6,
                      "temperature": 0.8, "top_p": 0.9, "seed": 5}),
            ("t2i", {"prompt": "blue car", "num_inference_steps": 3, "cfg_text_scale": 1.0, "seed": 4}),
            ("think-t2i", {"prompt": "a cat", "num_inference_steps": 2, "max_tokens": 2, "seed": 6}),
            ("edit", {"prompt": "make it red", "num_inference_steps": 2, "seed": 8}),
        ]  # fmt: skip
        return [
            bagel.job(
                bagel.prepare(p, task=task, request_id=f"r{i}", parts=[PICTURE] if task == "edit" else [])
            )
            for i, (task, p) in enumerate(params)
            if task in tasks
        ]

    return items


def test_interleave_gate_with_chat_t2i_and_think_t2i_mixed(bagel):
    report = assert_interleave_parity(Engine, _mixed(bagel))
    assert report.ok and report.max_abs == 0.0
    assert bagel.instance.kv_pool.drain() == 0  # every context's pages came back


def test_ragged_token_steps_batch_across_requests_bit_for_bit(bagel, monkeypatch):
    rows = []
    body = bagel_loop.token_body

    def spy(net, exact, inputs):
        rows.append(inputs["ids"].shape[0])
        return body(net, exact, inputs)

    monkeypatch.setattr(bagel_loop, "token_body", spy)
    report = check_batched_parity(Engine, _mixed(bagel, ("chat", "t2i")), tol=0.0)
    assert (
        report.max_abs == 0.0 and max(rows) >= 2
    )  # token steps of requests of different lengths shared calls


def test_token_steps_of_different_length_buckets_share_a_call(bagel, monkeypatch):
    """Contexts of 4 and 60 tokens (buckets 16 and 64) are rows of one call, padded to the longest
    (WorkPlan.ragged), and so are the prompts' prefills; each row's tokens equal its solo run's bit
    for bit."""
    calls, prefills = [], []
    token, text = bagel_loop.token_body, bagel_loop.text_body

    def token_spy(net, exact, inputs):
        calls.append(sorted(int(n) for n in inputs["ctx_valid"].sum(1)))
        return token(net, exact, inputs)

    def prefill_spy(net, exact, causal, inputs):
        prefills.append(inputs["ids"].shape)
        return text(net, exact, causal, inputs)

    monkeypatch.setattr(bagel_loop, "token_body", token_spy)
    monkeypatch.setattr(bagel_loop, "text_body", prefill_spy)
    monkeypatch.setattr(bagel.instance, "prefix_caching", False)  # the batched run prefills too

    def items():
        prompts = ["hi", "a long question about " + "the red cat " * 15]
        return [
            bagel.job(
                bagel.prepare({"prompt": p, "max_tokens": 5, "seed": 2}, task="chat", request_id=f"q{i}")
            )
            for i, p in enumerate(prompts)
        ]

    report = check_batched_parity(Engine, items, tol=0.0)
    assert report.max_abs == 0.0
    assert any(len(c) == 2 and c[0] <= 16 < 32 < c[1] for c in calls), calls
    assert any(shape[0] == 2 for shape in prefills), prefills  # 4 and 60 tokens: one padded call


def golden_run(bagel) -> dict:
    chat = bagel.generate(task="chat", prompt="describe the image", max_tokens=12, temperature=0.9, seed=7)
    image = bagel.generate(task="t2i", prompt="a red cat on a table", num_inference_steps=5, seed=7)
    edit = bagel.generate(task="edit", parts=[PICTURE], prompt="make it blue", num_inference_steps=3, seed=7)
    think = bagel.generate(task="think-t2i", prompt="a cat", num_inference_steps=3, max_tokens=6, seed=7)
    return {
        "chat_tokens": chat.provenance["metrics"]["completion_tokens"], "chat_text": chat.text,
        "image_mean": float(image.image.mean()), "image_corner": image.image[:2, :2].reshape(-1).tolist(),
        "edit_mean": float(edit.image.mean()), "edit_corner": edit.image[:2, :2].reshape(-1).tolist(),
        "thinking": think.text.text,
        "think_mean": float(think.image.mean()),
    }  # fmt: skip


def test_golden_trajectory(bagel):
    """The tiny checkpoint's outputs as recorded (FV_BAGEL_RECORD=1 rewrites the file)."""
    import os

    got = golden_run(bagel)
    if os.environ.get("FV_BAGEL_RECORD"):
        GOLDEN.write_text(json.dumps(got, indent=1) + "\n")
    assert GOLDEN.is_file(), f"{GOLDEN} is missing. Fix: record it with FV_BAGEL_RECORD=1"
    want = json.loads(GOLDEN.read_text())
    assert got["chat_text"] == want["chat_text"] and got["chat_tokens"] == want["chat_tokens"]
    assert got["thinking"] == want["thinking"]
    for name in ("image", "edit", "think"):
        assert abs(got[f"{name}_mean"] - want[f"{name}_mean"]) < 1e-5, name
    for name in ("image", "edit"):
        assert np.allclose(got[f"{name}_corner"], want[f"{name}_corner"], atol=1e-5), name


def test_cli_writes_the_image_and_the_answer(bagel_host, bagel_path, tmp_path, monkeypatch):
    from fv_core.cli import main

    monkeypatch.setattr("fv_core.cli.load_plugins", lambda: bagel_host)
    base = ["generate", "--model", "bagel-tiny", "--weights", bagel_path, "--prompt", "a cat"]
    assert main([*base, "--task", "t2i", "--steps", "3", "-o", str(tmp_path / "cat.png")]) == 0
    assert json.loads((tmp_path / "cat.json").read_text())["task"] == "t2i"
    assert main([*base, "--max-tokens", "3", "-o", str(tmp_path / "a.txt")]) == 0
    assert json.loads((tmp_path / "a.json").read_text())["task"] == "chat"


def test_think_t2i_writes_its_thinking_into_the_generation_context(bagel, tmp_path):
    """The AR stage plans under BAGEL's thinking system prompt; the denoise reuses its caches (system
    prompt: text-unconditioned, + prompt: image-unconditioned, + thinking: conditional); plain t2i runs
    no AR step."""
    thought = bagel.generate(
        task="think-t2i", prompt="a red cat", num_inference_steps=3, max_tokens=5, seed=2
    )
    stages = thought.provenance["metrics"]["stages"]
    assert stages["0:think"]["completion_tokens"] == 5
    assert isinstance(thought.text, TextArtifact) and thought.text.text  # the thinking, its own artifact
    assert thought.text.provenance is thought.provenance
    saved = thought.save(tmp_path / "cat.png")
    assert saved.with_suffix(".txt").read_text() == thought.text.text
    assert stages["1:t2i"]["branches_run"] == [2, 2]
    plain = bagel.generate(task="t2i", prompt="a red cat", num_inference_steps=3, seed=2)
    assert "stages" not in plain.provenance["metrics"] and not np.array_equal(plain.image, thought.image)


def test_edit_conditions_on_the_image_and_takes_its_size(bagel):
    """cond = [image latents, image ViT tokens, instruction]; text-unconditioned = the image; image-
    unconditioned = the instruction: three rows per step over the whole schedule (BAGEL's edit defaults)."""
    edited = bagel.generate(task="edit", parts=[PICTURE], prompt="make it red", num_inference_steps=3)
    assert edited.image.shape == (64, 96, 3)  # short side up to 64 (the tiny's 512), multiples of 16
    assert edited.provenance["metrics"]["branches_run"] == [3, 3]
    assert edited.provenance["params"]["cfg_renorm_type"] == "text_channel"
    with pytest.raises(ConfigError, match="needs exactly one image"):
        bagel.prepare({"prompt": "make it red"}, task="edit")


def test_chat_streams_its_text_token_by_token(bagel):
    """Each token step's partial event carries the text it settled; together they are the answer (text
    that may start a stop string is held back until it cannot)."""
    engine = Engine()
    events = []
    engine.on_event = events.append
    for i, stop in enumerate(([], ["e"])):
        request = bagel.prepare(
            {"prompt": "describe the image", "max_tokens": 10, "stop": stop}, task="chat", request_id=f"s{i}"
        )
        result = engine.run_one(*bagel.job(request))
        deltas = [e.data["delta"] for e in events if e.kind == "partial" and e.request_id == f"s{i}"]
        assert len(deltas) == result.metrics["steps"] and "".join(deltas) == result.outputs["text"]


def test_sdpa_math_interleaves_bitwise_and_batches_within_tolerance(fresh):
    """The published card's math (F.linear, SDPA over padded contexts): interleaving is still bit for bit;
    a batched or ragged step differs from a solo one only by summation order."""
    model = fresh
    model.instance.exact = False

    def items():
        params = [
            ("chat", {"prompt": "hi", "max_tokens": 4}),
            ("chat", {"prompt": "what is in the picture?", "max_tokens": 4, "temperature": 0.5, "seed": 2}),
            ("t2i", {"prompt": "a red cat", "num_inference_steps": 2, "seed": 3}),
            ("t2i", {"prompt": "a blue car at night", "num_inference_steps": 2, "seed": 4}),
        ]
        return [model.job(model.prepare(p, task=t, request_id=f"f{i}")) for i, (t, p) in enumerate(params)]

    assert assert_interleave_parity(Engine, items).max_abs == 0.0
    check_batched_parity(Engine, items, tol=1e-4)


def _drive(loop, request):
    from fv_core.loop import Done, StepResult

    with torch.inference_mode():
        state = loop.init(request)
        while not isinstance(plan := loop.next(state), Done):
            state = loop.advance(state, StepResult(plan.body(plan.inputs)))
    return state


@pytest.mark.parametrize("task", ["edit", "think-t2i"])
def test_cfg_contexts_share_their_common_prefix_pages(bagel, task):
    """edit: cond = [image latents, ViT, instruction] extends text-unconditioned = [image latents, ViT];
    think-t2i: cond = [system, prompt, thinking] extends image-unconditioned = [system, prompt], which
    extends text-unconditioned = [system] (forks of the AR stage's context). Full pages of a common
    prefix are one page of the pool; only a partly filled last page is copied when a context writes."""
    pool = bagel.instance.kv_pool
    parts = [PICTURE] if task == "edit" else []
    params = {
        "prompt": "make it red",
        "num_inference_steps": 2,
        **({} if task == "edit" else {"max_tokens": 3}),
    }
    request = bagel.prepare(params, task=task, parts=parts)
    if task == "edit":
        loop = bagel.loop("edit")
        state = _drive(loop, request)
    else:
        program = bagel.runnable(task)
        results: dict = {}
        for i, stage in enumerate(program.stages):
            loop = stage.loop
            state = _drive(loop, program.stage_request(i, request, results))
            if i == 0:
                results[stage.name] = loop.finalize(state)
    ctx = {name: c["seq"] for name, c in DenoiseState.of(state).ctx.items()}
    cond, text, img = ctx["cond"], ctx["text_uncond"], ctx["img_uncond"]
    page = pool.page_size
    if task == "edit":
        shared = text["length"] // page
        assert shared >= 1 and cond["pages"][:shared] == text["pages"][:shared]
        assert not set(img["pages"]) & set(cond["pages"] + text["pages"])
    else:
        assert img["pages"][: img["length"] // page] == cond["pages"][: img["length"] // page]
        assert text["pages"][: text["length"] // page] == img["pages"][: text["length"] // page]
    loop.release(state)
    assert pool.drain() == 0


def test_bad_input_names_the_value_the_rule_and_the_fix(bagel):
    with pytest.raises(ConfigError, match="positions.*Fix: shorten the prompt or lower max_tokens"):
        bagel.generate(task="chat", prompt="hello", max_tokens=5000)  # the tiny's 4096 positions
    with pytest.raises(ConfigError, match="latent table.*Fix: use at most 128x128"):
        bagel.generate(task="t2i", prompt="a cat", height=144, width=96)
    with pytest.raises(ConfigError, match="not a readable image"):
        bagel.generate(task="chat", prompt="what is this?", image=b"not an image")
    with pytest.raises(ConfigError, match="cfg_interval"):
        bagel.prepare({"prompt": "a cat", "cfg_interval": (0.8, 0.2)}, task="t2i")
    with pytest.raises(ConfigError, match="stop"):
        bagel.prepare({"prompt": "a cat", "stop": "END"}, task="chat")  # a list of strings, not one


def test_ar_contexts_live_in_the_kv_pool_and_return_on_finish_and_cancel(fresh):
    """Chat contexts are pages of the instance's paged KV pool (its bytes count in the instance's
    resident bytes); a finished or cancelled request gives its pages back."""
    model = fresh
    pool = model.instance.kv_pool
    assert (
        model.instance.resident_bytes()
        >= pool.nbytes
        == model.card.caches["kv"].max_bytes // pool.page_bytes * pool.page_bytes
    )
    model.generate(task="chat", prompt="describe the image", max_tokens=20)
    assert pool.drain() == 0
    sched = Engine().scheduler(batching=True)
    for i in range(2):
        sched.submit(
            *model.job(
                model.prepare({"prompt": "hello there", "max_tokens": 30}, task="chat", request_id=f"c{i}")
            )
        )
    for _ in range(8):
        sched.step()
    assert pool.used_pages > 0
    sched.cancel("c0")
    while sched.has_work():
        sched.step()
    assert pool.drain() == 0


@pytest.mark.parametrize("task", ["edit", "think-t2i"])
def test_shared_prefix_pages_equal_private_copies_bit_for_bit(bagel, task, monkeypatch):
    parts = [PICTURE] if task == "edit" else []
    params = {
        "prompt": "make it red",
        "num_inference_steps": 2,
        **({} if task == "edit" else {"max_tokens": 3}),
    }
    shared = bagel.generate(task=task, parts=parts, **params)
    pool = bagel.instance.kv_pool

    def private(seq):  # a copy of every page instead of a reference
        k, v = pool.read(seq)
        return pool.append(KVSeq(), k, v) if seq.length else KVSeq()

    monkeypatch.setattr(pool, "fork", private)
    copied = bagel.generate(task=task, parts=parts, **params)
    assert np.array_equal(shared.image, copied.image) and pool.drain() == 0
