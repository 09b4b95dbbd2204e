"""KV re-cache on a prompt change (``recache_on_prompt_change``, fv_wan.causal_recache) on the tiny causal
card: a session continued under a new prompt re-runs its window's frames under the new text (what a full
recompute of those frames under it holds), which changes the next chunk; under an unchanged prompt it
runs nothing (bit for bit the request without it); sessions re-caching interleave bitwise; bad values
name the value, the rule and the fix."""

from __future__ import annotations

import pytest
import torch

import fv_core
from fv_core import ConfigError
from fv_core.kv import KVSeq
from fv_core.loop import StepResult
from fv_core.runtime import Engine
from fv_core.serving.realtime import RealtimeSession
from fv_wan.causal_transformer import causal_forward, frame_rope

CAUSAL = "wan2.1-t2v-tiny-causal"
SIZE = dict(height=16, width=16)  # one token per latent frame: fast
FIRST, SECOND = "a red cat in the snow", "a blue dog on the beach"


@pytest.fixture(scope="module")
def model(wan_host, tiny_path):
    return fv_core.load(CAUSAL, tiny_path, host=wan_host)


def ask(model, sid, prompt, seed, frames, **params):
    raw = {"prompt": prompt, "num_frames": frames, "seed": seed, "session_id": sid, **SIZE, **params}
    return model.prepare(raw, request_id=f"{sid}-{seed}")


def session(model, second: str, recache: bool, interleaved_with=None):
    """A session of 5 frames (2 latent frames) under FIRST, then one latent frame under ``second``: its
    results and the keys/values it holds (frames 0..2: the window is full, nothing evicted). With
    ``interleaved_with`` (another such session's arguments), both run interleaved step by step."""
    sessions = [(second, recache)] + ([interleaved_with] if interleaved_with else [])
    sids = [model.open_session() for _ in sessions]
    pairs = list(zip(sids, sessions, strict=True))
    rounds = [
        [ask(model, sid, FIRST, 1, 5) for sid in sids],
        [ask(model, sid, prompt, 3, 1, recache_on_prompt_change=r) for sid, (prompt, r) in pairs],
    ]
    results = []
    with torch.inference_mode():
        for requests in rounds:
            results += Engine().run_interleaved([model.job(r) for r in requests])
    held = model.instance.sessions._open[sids[0]].seq
    kv = model.instance.kv_pool.read(KVSeq(**held))
    assert all(model.close_session(sid) for sid in sids)
    return results, kv


@pytest.fixture(scope="module")
def runs(model):
    """The four sessions, each run alone: (new prompt?, re-cache?) -> (results, held keys/values)."""
    return {
        (new, recache): session(model, SECOND if new else FIRST, recache)
        for new in (True, False)
        for recache in (True, False)
    }


def full_recompute(model, latents: torch.Tensor, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Every block's keys/values of clean ``latents`` at the context timestep (0) under ``prompt``,
    without a cache: all frames in one pass, each seeing itself and the frames before it."""
    loop = model.loop("causal")
    state = loop.init(model.prepare({"prompt": prompt}, request_id="text"))
    while state.values["phase"] in ("encode", "text_kv"):
        plan = loop.next(state)
        state = loop.advance(state, StepResult(plan.body(plan.inputs)))
    kv, length = state.tensors["kv.transformer"][:1], state.tensors["input_ids"].shape[1]
    kv = torch.cat([kv, kv[:, :, :, -1:].expand(-1, -1, -1, length - kv.shape[3], -1)], 3)  # unfolded
    loop.release(state)
    dit = model.instance.component("transformer")
    _, _, frames, h, w = latents.shape
    _, p_h, p_w = dit.config.patch_size
    tpf = (h // p_h) * (w // p_w)
    mask = torch.ones(frames, frames, dtype=torch.bool).tril().repeat_interleave(tpf, 0)
    mask = mask.repeat_interleave(tpf, 1)[None, None]
    heads, dim = dit.config.num_attention_heads, dit.config.attention_head_dim
    empty = latents.new_zeros(1, len(dit.blocks), heads, 0, dim)
    rope = frame_rope(dit, 0, frames, h, w)
    out = causal_forward(dit, latents, torch.zeros(1), kv, rope, empty, empty, mask)
    return out["k"][0], out["v"][0]


def test_a_new_prompt_recaches_the_window_under_its_text(model, runs):
    """Re-cached, the session holds what a full recompute of its frames under the new prompt holds
    (without, its first frames keep the old prompt's), and the new chunk differs."""
    (first, recached), (k, v) = runs[True, True]
    (_, plain), (plain_k, _) = runs[True, False]
    latents = torch.cat([first.outputs["latents"], recached.outputs["latents"]], 2)
    with torch.inference_mode():
        ref_k, ref_v = full_recompute(model, latents, SECOND)
    assert (k - ref_k).abs().max() <= 1e-5 and (v - ref_v).abs().max() <= 1e-5
    assert (plain_k - ref_k).abs().max() > 1e-4  # without: frames 0..1 attended to FIRST
    assert plain.metrics["recached_frames"] == 0 and recached.metrics["recached_frames"] == 2
    assert recached.metrics["passes"] == plain.metrics["passes"] + 2  # one pass per cached frame
    # the tiny random weights' text moves little: the chunks differ beyond float noise, not by much
    assert (plain.outputs["latents"] - recached.outputs["latents"]).abs().max() > 1e-5
    assert model.instance.kv_pool.used_pages == 0  # the re-caches' and the sessions' pages came back


def test_an_unchanged_prompt_recaches_nothing(runs):
    ((_, plain), plain_kv), ((_, asked), asked_kv) = runs[False, False], runs[False, True]
    assert asked.metrics["recached_frames"] == 0 and asked.metrics["passes"] == plain.metrics["passes"]
    assert torch.equal(plain.outputs["latents"], asked.outputs["latents"])
    assert torch.equal(plain.outputs["frames"], asked.outputs["frames"])
    assert all(torch.equal(a, b) for a, b in zip(plain_kv, asked_kv, strict=True))


def test_sessions_recaching_interleave_bitwise(model, runs):
    """A session re-caching, interleaved step by step with another one that does not, equals each alone."""
    results, kv = session(model, SECOND, True, interleaved_with=(SECOND, False))
    alone = runs[True, True][0] + runs[True, False][0]
    first_a, first_b, second_a, second_b = results
    for x, y in zip((first_a, second_a, first_b, second_b), alone, strict=True):
        assert torch.equal(x.outputs["latents"], y.outputs["latents"])
    assert all(torch.equal(a, b) for a, b in zip(kv, runs[True, True][1], strict=True))


def test_bad_values_name_the_value_the_rule_and_the_fix(model):
    with pytest.raises(ConfigError) as info:
        model.prepare({"prompt": "x", "recache_on_prompt_change": "maybe"})
    assert "recache_on_prompt_change" in str(info.value) and "'maybe'" in str(info.value)
    assert "valid boolean" in str(info.value) and "Fix:" in str(info.value)
    session = RealtimeSession("s", CAUSAL, model, None, 16.0, {"prompt": FIRST})
    with pytest.raises(ConfigError, match=r"recache='yes': .* true or false\. Fix: e\.g\. recache=true"):
        session.steer("a blue dog", recache="yes")
    session.steer("a blue dog", recache=True)  # a steer's re-cache holds from the next chunk on
    assert session.chunk_params(1)["recache_on_prompt_change"] is True
