"""Causal Wan (wan2.1-t2v-tiny-causal): chunked autoregressive decode over a paged KV cache.

The cached loop equals the same causal model computed by full recompute (every earlier chunk re-run
from the patch embedding up under the block mask of its rolling window); the window keeps its sinks and
never holds more than its frames; interleaved requests equal serial ones bit for bit; pages come back
on finish and on cancel; every finished chunk streams its frames, which are the final video's."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import fv_core
from fv_core import ConfigError, LoadedModel, RecipeLoopMismatch
from fv_core.kv import KVSeq, PagedKVPool
from fv_core.loop import Done, StepResult
from fv_core.parity import check_batched_parity
from fv_core.runtime import Engine
from fv_core.testing import CardContract
from fv_wan import causal_loop
from fv_wan import causal_transformer as causal
from fv_wan.bodies import decode_body
from fv_wan.causal_loop import CausalWanLoop
from fv_wan.causal_reference import recompute_generate
from fv_wan.causal_window import drop_tokens, evict, window_after
from fv_wan.model import CausalWanModel

CAUSAL = "wan2.1-t2v-tiny-causal"


@pytest.fixture(scope="module")
def model(wan_host, tiny_path):
    return fv_core.load(CAUSAL, tiny_path, host=wan_host)


def prepared(model, rid="r", **params):
    return model.prepare({"prompt": "a cat in the snow", **params}, request_id=rid)


def run(model, request, on_event=None):
    with torch.inference_mode():
        return Engine(on_event=on_event).run_one(*model.job(request))


def reference(model, request) -> torch.Tensor:
    """The request's latents by full recompute: the prompt's text keys/values from the loop (unfolded), then
    ``recompute_generate`` on noise drawn as the loop draws it."""
    loop, p = model.loop("causal"), request.params
    with torch.inference_mode():
        state = loop.init(request)
        while state.values["phase"] in ("encode", "text_kv"):
            plan = loop.next(state)
            state = loop.advance(state, StepResult(plan.body(plan.inputs)))
        kv, shape = state.tensors["kv.transformer"][:1], state.tensors["noise"].shape
        length = state.tensors["input_ids"].shape[1]  # the loop keeps them folded: whole, as Wan has them
        kv = torch.cat([kv, kv[:, :, :, -1:].expand(-1, -1, -1, length - kv.shape[3], -1)], 3)
        loop.release(state)
        gen = torch.Generator().manual_seed(p.seed)
        noise = torch.randn(shape, generator=gen)
        fixed = model.card.loops["causal"].steps.fixed_timesteps
        return recompute_generate(model.instance.component("transformer"), kv, noise, p, fixed, gen)


class TestCausalCard(CardContract):
    """The card contract: C1 against the same causal model by full recompute (then the VAE's own decode
    of all latents), the interleave gate, the card's defaults."""

    @pytest.fixture(scope="class")
    def contract_model(self, model):
        return model

    @pytest.fixture(scope="class")
    def contract_reference(self, model):
        def frames(params):
            latents = reference(model, model.prepare(params, request_id="ref"))
            with torch.inference_mode():
                return decode_body(model.instance.component("vae"), {"latents": latents})["frames"][0].numpy()

        return frames

    @pytest.fixture
    def contract_requests(self):
        return [
            dict(prompt="a red circle moving left", seed=1, num_frames=13, window_frames=2, sink_frames=1),
            dict(
                prompt="a boat at sunset",
                seed=2,
                num_frames=21,  # 2 chunks of 3 latent frames
                chunk_frames=3,
                window_frames=4,
                sink_frames=1,
            ),
        ]


@pytest.mark.parametrize(
    "params",
    [
        dict(num_frames=13, chunk_frames=1, window_frames=8, sink_frames=0),  # no eviction
        dict(num_frames=17, chunk_frames=1, window_frames=2, sink_frames=1),  # rolling, one sink
        dict(num_frames=29, chunk_frames=2, window_frames=4, sink_frames=1, context_timestep=100),
    ],
    ids=["full-window", "rolling-sink", "chunk2-noisy-context"],
)
def test_cached_chunks_equal_full_recompute(model, params):
    request = prepared(model, seed=7, **params)
    result = run(model, request)
    ref = reference(model, request)
    diff = (result.outputs["latents"] - ref).abs().max().item()
    assert diff <= 1e-5, f"cached vs full recompute: max |diff| {diff:.3g}"
    assert ref.abs().max() > 0.5  # a real video, not zeros
    if params["window_frames"] < 8:
        assert result.metrics["evicted_frames"]  # the window dropped frames: the rolling path ran


def test_the_window_and_the_context_change_the_video(model):
    """The equivalence above is not vacuous: a chunk's output depends on what its window holds."""
    wide = run(model, prepared(model, seed=7, num_frames=17, window_frames=8, sink_frames=0))
    rolling = run(model, prepared(model, seed=7, num_frames=17, window_frames=2, sink_frames=1))
    first, later = wide.outputs["latents"], rolling.outputs["latents"]
    assert torch.equal(first[:, :, :3], later[:, :, :3])  # chunks 0-2 saw the same frames
    assert (first[:, :, 3:] - later[:, :, 3:]).abs().max() > 1e-3  # chunk 3 saw frame 1 in one, not the other


def test_window_policy():
    assert evict([0, 1, 2], 1, 3, 1) == ([0, 2], [1])
    assert evict([0, 1], 1, 3, 1) == ([0, 1], [])
    assert window_after(3, 1, 2, 1) == [0, 2] and window_after(4, 1, 2, 1) == [0, 3]
    assert window_after(3, 2, 4, 1) == [0, 3, 4, 5]  # room for a chunk of 2: frames 1 and 2 go
    assert window_after(5, 1, 3, 0) == [2, 3, 4]


@pytest.mark.parametrize("page_size", [2, 3, 4])
def test_dropping_frames_keeps_the_rest_in_order(page_size):
    """Whole pages go back when the dropped tokens fill whole pages; otherwise a copy; same contents."""
    pool = PagedKVPool(2, 2, 4, page_size=page_size, num_pages=64)
    k = torch.randn(2, 2, 12, 4)
    seq = pool.append(KVSeq(), k, -k)
    kept = drop_tokens(pool, seq, 4, 8)
    got_k, got_v = pool.read(kept)
    want = torch.cat([k[:, :, :4], k[:, :, 8:]], 2)
    assert torch.equal(got_k, want) and torch.equal(got_v, -want)
    assert pool.used_pages == pool.pages_for(8)
    if page_size in (2, 4):  # aligned: the kept pages are the original ones
        assert set(kept.pages) <= set(seq.pages)
    pool.release(kept)
    assert pool.used_pages == 0


def _drive(loop, request, on_write=None):
    with torch.inference_mode():
        state = loop.init(request)
        while not isinstance(plan := loop.next(state), Done):
            phase = state.values["phase"]
            state = loop.advance(state, StepResult(plan.body(plan.inputs)))
            if phase == "chunk_write" and on_write is not None:
                on_write(state)
        return state, loop.finalize(state)


def test_rolling_window_keeps_sinks_and_never_exceeds_the_window(model):
    """After every cache write the request's sequence holds at most window_frames frames (pages of the
    pool), its first sink_frames frames always, and its newest chunk."""
    pool, window, sink = model.instance.kv_pool, 3, 2
    request = prepared(model, num_frames=25, window_frames=window, sink_frames=sink)  # 7 latent frames
    seen = []

    def check(state):
        v = state.values
        frames, seq, tpf = v["cache_frames"], v["seq"], v["tokens_per_frame"]
        assert len(frames) <= window and seq["length"] == len(frames) * tpf
        assert len(seq["pages"]) == pool.pages_for(seq["length"]) <= pool.pages_for(window * tpf)
        assert frames[: min(sink, len(frames))] == list(range(min(sink, len(frames))))
        assert frames[-1] == v["chunk"] - 1  # the chunk just written
        assert pool.used_pages == len(seq["pages"])
        seen.append(list(frames))

    _, result = _drive(model.loop("causal"), request, check)
    assert seen == [[0], [0, 1], [0, 1, 2], [0, 1, 3], [0, 1, 4], [0, 1, 5]]
    assert result.metrics["evicted_frames"] == [2, 3, 4] and result.metrics["max_cached_frames"] == window
    assert pool.used_pages == 0


def _items(model, batched_shapes=False):
    def items():
        reqs = [
            prepared(model, "a", seed=1, num_frames=17, window_frames=2, sink_frames=1),
            prepared(model, "b", seed=2, prompt="a red car at night", num_frames=13),
            prepared(model, "c", seed=3, num_frames=21, chunk_frames=2, window_frames=4),
        ]
        if batched_shapes:
            reqs.append(prepared(model, "d", seed=4, prompt="a boat", num_frames=17))
        return [model.job(r) for r in reqs]

    return items


def test_chunk_steps_of_different_requests_batch(model, monkeypatch):
    """Chunk passes of requests with equal chunk shapes and context buckets share one call (rows padded
    to the bucket), and so do their chunk decodes (feature caches of equal shapes); batched equals serial
    within the card's batched tolerance."""
    rows, decoded = [], []
    body, decode = causal.chunk_body, causal_loop.chunk_decode_body

    def spy(transformer, inputs):
        rows.append(inputs["latents"].shape[0])
        return body(transformer, inputs)

    def decode_spy(vae, inputs):
        decoded.append(inputs["latents"].shape[0])
        return decode(vae, inputs)

    monkeypatch.setattr(causal, "chunk_body", spy)
    monkeypatch.setattr(causal_loop, "chunk_body", spy)
    monkeypatch.setattr(causal_loop, "chunk_decode_body", decode_spy)
    tol = model.card.parity.tolerances["frames_batched"]
    report = check_batched_parity(Engine, _items(model, batched_shapes=True), tol)
    assert report.ok and max(rows) >= 2 and max(decoded) >= 2
    assert model.instance.kv_pool.used_pages == 0


def test_pages_come_back_after_finish_and_cancel(model):
    pool = model.instance.kv_pool
    assert model.instance.resident_bytes() >= pool.nbytes > 0
    sched = Engine().scheduler(batching=True)
    for i in range(2):
        sched.submit(*model.job(prepared(model, f"p{i}", seed=i, num_frames=17)))
    with torch.inference_mode():
        for _ in range(20):
            sched.step()
        assert pool.used_pages > 0
        sched.cancel("p0")
        while sched.has_work():
            sched.step()
    assert pool.used_pages == 0 and pool.reserved_pages == 0


def test_a_request_waits_for_kv_pages_instead_of_running_out(model, tiny_path):
    """The pool is the scheduler's KV budget: with room for one window (4 pages) a second request
    needing 3 pages waits until the first gives its pages back; one needing more than the pool is
    refused up front, naming the numbers."""
    from fv_core.runtime.admission import AdmissionInfeasible

    card = model.card
    small = card.caches["causal_kv"].model_copy(update={"max_bytes": 4 * 2048})  # 4 pages of 4 tokens
    card = card.model_copy(update={"caches": {**card.caches, "causal_kv": small}})
    tight = LoadedModel(card, CausalWanModel(card, tiny_path), tiny_path, source=card.model_id)
    pool = tight.instance.kv_pool
    assert pool.num_pages == 4 and pool.page_size == 4
    sched = Engine().scheduler(batching=True)
    entries = [sched.submit(*tight.job(prepared(tight, f"w{i}", seed=i, num_frames=17))) for i in range(2)]
    peak, running = 0, set()
    with torch.inference_mode():
        while sched.has_work():
            sched.step()
            peak = max(peak, pool.used_pages)
            running.add(sum(e.phase == "running" for e in entries))
    assert peak == 3 and max(running) == 1 and pool.used_pages == pool.reserved_pages == 0
    for i, entry in enumerate(entries):  # waiting changed nothing
        alone = run(tight, prepared(tight, f"s{i}", seed=i, num_frames=17))
        assert entry.result is not None and torch.equal(
            entry.result.outputs["frames"], alone.outputs["frames"]
        )
    with pytest.raises(AdmissionInfeasible, match="KV needs 5 pages of 4 tokens"):
        sched.submit(*tight.job(prepared(tight, "big", num_frames=25, window_frames=5)))


def test_every_chunk_streams_its_frames(model):
    """Each finished chunk's ``partial`` event carries its frames (decoded with the VAE's causal cache);
    together they are the final video, which equals decoding all latents at once."""
    parts = []
    result = run(
        model,
        prepared(model, seed=5, num_frames=13),
        on_event=lambda e: e.kind == "partial" and parts.append(e.data),
    )
    assert [p["chunk"] for p in parts] == [0, 1, 2, 3]
    assert [p["frames"].shape[0] for p in parts] == [1, 4, 4, 4]
    streamed = torch.cat([p["frames"] for p in parts])
    assert torch.equal(streamed, result.outputs["frames"])
    with torch.inference_mode():
        whole = decode_body(model.instance.component("vae"), {"latents": result.outputs["latents"]})[
            "frames"
        ][0]
    assert (whole - streamed).abs().max().item() <= 1e-5


def test_bad_values_name_the_value_the_rule_and_the_fix(model, tiny_model, variant_folders):
    cases = [
        (dict(guidance_scale=5.0), "guidance_scale=5.0", "Fix: use guidance_scale=1.0"),
        (dict(num_frames=13, chunk_frames=3), "num_frames=13 makes 4 latent frames", "Fix: use num_frames=9"),
        (
            dict(window_frames=2, sink_frames=2),
            "window_frames=2 cannot hold sink_frames=2",
            "window_frames>=3",
        ),
    ]
    for params, value, fix in cases:
        with pytest.raises(ConfigError) as info:
            prepared(model, **params)
        assert value in str(info.value) and fix in str(info.value)
    with pytest.raises(RecipeLoopMismatch, match="exactly 4 steps"):
        prepared(model, num_inference_steps=3)
    with pytest.raises(ConfigError, match="sink_frames"):
        prepared(model, sink_frames=-1)
    with pytest.raises(ConfigError, match="runs on a CausalWanModel"):
        CausalWanLoop(tiny_model)
    with pytest.raises(ConfigError, match="'concat' image conditioning.*Fix: load a Wan2.1 T2V folder"):
        CausalWanModel(model.card, variant_folders["i2v", "first"])


def test_rolled_out_chunk_passes_replay_bit_for_bit_and_pass_c2(model):
    """The core's rollout records every chunk pass with the context it gathered; replay reproduces
    each (alone, or its whole batched call) and the train profile equals the serve one (C2)."""
    from fv_core.loop.contracts import Profile
    from fv_core.training.rollout import call_of, check_c2, replay_call, replay_step, rollout

    asks = [
        dict(prompt="a cat", seed=1, num_frames=13, window_frames=2),
        dict(prompt="a dog", seed=2, num_frames=13),
    ]
    rolled = rollout(model, [model.prepare(a, request_id=f"r{i}") for i, a in enumerate(asks)])
    records = [r.record for r in rolled]
    passes = [(rec, i) for rec in records for i, s in enumerate(rec.steps) if s.label.startswith("chunk")]
    assert len(passes) == 2 * (4 * 4 + 3) and any(rec.steps[i].batched_with > 1 for rec, i in passes)
    for rec, i in passes:
        members = call_of(records, rec, i)
        (out,) = [
            o for (r, k), o in zip(members, replay_call(model, members), strict=True) if (r, k) == (rec, i)
        ]
        assert torch.equal(out["velocity"], rec.steps[i].outputs["velocity"]), rec.steps[i].label
    rec, i = next((r, k) for r, k in passes if r.steps[k].kind == "ar_prefill")
    served = replay_step(model, rec, i, Profile.SERVE)
    trained = check_c2(model, rec, i, ["velocity", "k", "v"])
    assert trained["velocity"].requires_grad and torch.equal(trained["k"].detach(), served["k"])
    decode = next(k for k, s in enumerate(rec.steps) if s.label.startswith("decode chunk"))
    with pytest.raises(ConfigError, match="feature cache"):
        replay_step(model, rec, decode)


def test_a_single_chunk_writes_nothing(model):
    result = run(model, prepared(model, num_frames=1))
    assert result.outputs["frames"].shape[0] == 1 and result.metrics["max_cached_frames"] == 0


def test_generate_writes_a_video(model, tmp_path):
    video = model.generate(prompt="a dog running on the beach", num_frames=9, seed=1)
    assert video.frames.shape == (9, 32, 32, 3) and np.isfinite(video.frames).all()
    assert video.provenance["card"] == CAUSAL and video.provenance["params"]["chunk_frames"] == 1
    path = video.save(tmp_path / "causal.mp4")
    assert path.exists() and path.stat().st_size > 0


def test_fv_generate_streams_the_chunks_into_the_mp4(wan_host, tiny_path, tmp_path, monkeypatch, capsys):
    """``--stream`` writes each chunk's frames into the mp4 as they come; the file holds the whole
    video and its provenance is beside it. A task that streams nothing is written whole; sound refuses."""
    import imageio.v2 as imageio

    from fv_core.cli import main

    writes = []
    monkeypatch.setattr("fv_core.cli.load_plugins", lambda: wan_host)
    monkeypatch.setattr(
        "fv_core.artifacts.VideoStream.write", spy(writes, fv_core.artifacts.VideoStream.write)
    )
    base = ["generate", "--weights", tiny_path, "--prompt", "a cat", "--num-frames", "9", "--stream"]
    assert main([*base, "--model", CAUSAL, "-o", str(tmp_path / "cat.mp4")]) == 0
    assert writes == [1, 4, 4]  # a chunk of 1 latent frame, then 2 of 4 frames each
    assert len(imageio.mimread(tmp_path / "cat.mp4")) == 9 and (tmp_path / "cat.json").is_file()
    plain = ["--model", "wan2.1-t2v-tiny", "--steps", "2", "--size", "32x32", "-o", str(tmp_path / "dog.mp4")]
    assert main([*base, *plain]) == 0 and "streams no frames" in capsys.readouterr().out
    assert len(imageio.mimread(tmp_path / "dog.mp4")) == 9
    assert main([*base, "--model", CAUSAL, "-o", str(tmp_path / "cat.png")]) == 2


def spy(calls: list, write):
    def recorded(self, frames):
        calls.append(len(frames))
        return write(self, frames)

    return recorded


def test_a_served_video_streams_its_chunks_as_server_sent_events(wan_host, tiny_path, model, tmp_path):
    """``GET /v1/videos/{id}/stream``: every chunk's frames (lossless PNGs, the front door's frames),
    then the finished job; a finished job streams the job alone. ``/v1/sessions``: videos that go on."""
    import base64
    import io
    import json

    import httpx
    from PIL import Image

    from fv_core.artifacts import to_uint8
    from fv_core.deploy.card import parse_deploy
    from tests.serving.support import ServerThread

    deploy = parse_deploy(
        {
            "plugins": ["fv-wan"],
            "models": [{"card": CAUSAL, "weights": tiny_path}],
            "data_dir": str(tmp_path),
            "limits": {"max_running": 1},
        }
    )
    with ServerThread(deploy, wan_host) as server, httpx.Client(base_url=server.url, timeout=120) as http:
        http.post("/v1/videos", json={"prompt": "a long one first", "num_frames": 33})  # runs first
        job = http.post("/v1/videos", json={"prompt": "a cat", "num_frames": 9, "seed": 3}).json()
        events = []
        with http.stream("GET", f"/v1/videos/{job['id']}/stream") as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
        chunks, final = events[:-1], events[-1]
        assert [(c["chunk"], c["first_frame"], len(c["frames"])) for c in chunks] == [
            (0, 0, 1),
            (1, 1, 4),
            (2, 5, 4),
        ]
        assert final["id"] == job["id"] and final["status"] == "completed"
        frames = [
            np.asarray(Image.open(io.BytesIO(base64.b64decode(f)))) for c in chunks for f in c["frames"]
        ]
        want = model.generate(prompt="a cat", num_frames=9, seed=3).frames
        assert np.array_equal(np.stack(frames), to_uint8(want))
        again = [line for line in http.get(f"/v1/videos/{job['id']}/stream").text.splitlines() if line]
        assert again[0] == "event: video" and json.loads(again[1][6:])["status"] == "completed"
        assert http.get("/v1/videos/video_nope/stream").status_code == 404
        # a session: the second video goes on from the first (4 frames per latent frame), then closes
        sid = http.post("/v1/sessions", json={"ttl_s": 60}).json()["id"]
        lengths = []
        for prompt in ("a cat", "the cat jumps"):
            video = http.post(
                "/v1/videos", json={"prompt": prompt, "num_frames": 9, "session_id": sid}
            ).json()
            lengths.append(finished(http, video)["seconds"])
        assert lengths == ["0.5625", "0.75"]  # 9 frames, then 12 at 16 fps
        assert http.delete(f"/v1/sessions/{sid}").json() == {
            "id": sid,
            "object": "session.deleted",
            "deleted": True,
        }
        assert http.delete(f"/v1/sessions/{sid}").status_code == 404
        gone = http.post("/v1/videos", json={"prompt": "x", "num_frames": 9, "session_id": sid}).json()
        gone = finished(http, gone)
        assert gone["status"] == "failed" and "not open here" in gone["error"]["message"]
        assert http.post("/v1/sessions", json={"ttl_s": -1}).status_code == 400


def finished(http, video: dict, timeout_s: float = 120.0) -> dict:
    """Poll a video job until it completes or fails."""
    deadline = time.monotonic() + timeout_s
    while video["status"] not in ("completed", "failed"):
        assert time.monotonic() < deadline, f"video {video['id']} still {video['status']}"
        time.sleep(0.05)
        video = http.get(f"/v1/videos/{video['id']}").json()
    return video


# ---- sessions: one video continued across requests ----


def continued(model, sid, rid, prompt, seed, frames=9):
    return model.prepare(
        {"prompt": prompt, "num_frames": frames, "seed": seed, "session_id": sid}, request_id=rid
    )


def test_a_session_continues_the_video_across_requests(model):
    """The second request starts at the session's frame count, attends to its cached frames (so it
    differs from the same request alone) and decodes on with the VAE's cache; close frees the pages."""
    pool = model.instance.kv_pool
    sid = model.open_session()
    first = run(model, continued(model, sid, "a", "a cat in the snow", 1))
    second = run(model, continued(model, sid, "b", "a dog on the beach", 2))
    assert first.metrics["first_latent_frame"] == 0 and second.metrics["first_latent_frame"] == 3
    assert first.outputs["frames"].shape[0] == 9 and second.outputs["frames"].shape[0] == 12  # 4 per latent
    alone = run(model, prepared(model, "c", prompt="a dog on the beach", seed=2, num_frames=9))
    assert not torch.equal(alone.outputs["latents"], second.outputs["latents"])
    assert pool.used_pages > 0  # the session keeps its window between requests
    assert model.close_session(sid) and not model.close_session(sid)
    assert pool.used_pages == 0 and pool.reserved_pages == 0


def test_two_sessions_never_see_each_other_and_interleave_bitwise(model):
    """Sessions A and B continued concurrently (with a one-shot request in the mix) equal each session
    continued alone, bit for bit."""

    def runs(interleaved: bool):
        a, b = model.open_session(), model.open_session()
        rounds = [
            [continued(model, a, "a1", "a red cat", 1), continued(model, b, "b1", "a blue car", 2),
             prepared(model, "o1", seed=3)],
            [continued(model, a, "a2", "the cat jumps", 4), continued(model, b, "b2", "the car turns", 5)],
        ]  # fmt: skip
        out = []
        with torch.inference_mode():
            for requests in rounds:
                jobs = [model.job(r) for r in requests]
                results = Engine().run_interleaved(jobs) if interleaved else Engine().run_serial(jobs)
                out += [r.outputs["latents"] for r in results]
        assert model.close_session(a) and model.close_session(b)
        return out

    together, apart = runs(True), runs(False)
    assert all(torch.equal(x, y) for x, y in zip(together, apart, strict=True))


def test_a_cancelled_continuation_leaves_the_session_at_its_last_finished_chunk(model):
    """Cancelled before its first chunk is written, a continuation changes nothing; cancelled after one,
    the session has exactly that chunk more. Either way the next continuation runs on."""
    sid, twin = model.open_session(), model.open_session()
    for s in (sid, twin):
        run(model, continued(model, s, f"{s}-1", "a cat", 1))
    sessions = model.instance.sessions
    sched = Engine().scheduler(batching=False)
    sched.submit(*model.job(continued(model, sid, "cut", "a dog", 2)))
    with torch.inference_mode():
        sched.step()  # the prompt's encode: no chunk yet
        sched.cancel("cut")
        while sched.has_work():
            sched.step()
    after = [run(model, continued(model, s, f"{s}-2", "a bird", 3)) for s in (sid, twin)]
    assert torch.equal(after[0].outputs["latents"], after[1].outputs["latents"])  # as if never asked
    frames = sessions._open[sid].frames
    sched.submit(*model.job(continued(model, sid, "half", "a fish", 4, frames=13)))
    with torch.inference_mode():
        while sessions._open[sid].frames == frames:  # until its first chunk is committed
            sched.step()
        sched.cancel("half")
        while sched.has_work():
            sched.step()
    assert sessions._open[sid].frames == frames + 1 and sessions._open[sid].busy is None
    next_one = run(model, continued(model, sid, "on", "a horse", 5))
    assert next_one.metrics["first_latent_frame"] == frames + 1
    for s in (sid, twin):
        model.close_session(s)
    assert model.instance.kv_pool.used_pages == 0


def test_sessions_refuse_what_they_cannot_follow(model):
    sid = model.open_session(ttl_s=30)
    run(model, continued(model, sid, "s1", "a cat", 1))
    with pytest.raises(
        ConfigError, match=r"changes \{'window_frames': 4\}.*Fix: send \{'window_frames': 3\}"
    ):
        run(model, model.prepare({"prompt": "x", "session_id": sid, "window_frames": 4}))
    with pytest.raises(ConfigError, match="not open here"):
        run(model, continued(model, "sess_nope", "s2", "a cat", 1))
    with pytest.raises(ConfigError, match="ttl_s=0"):
        model.open_session(ttl_s=0)
    assert model.instance.sessions.expire(now=time.monotonic() + 31) == [sid]  # idle past its ttl
    with pytest.raises(ConfigError, match="not open here"):
        run(model, continued(model, sid, "s3", "a cat", 1))
    assert model.instance.kv_pool.used_pages == 0


def test_a_session_keeps_the_adapter_it_started_with(model, tmp_path):
    """A session's cached keys/values were made with its first request's transformer adapters: a
    continuation runs with the same ones (and differs from the session without them); another set is
    refused naming the session's."""
    from safetensors.torch import save_file

    from fv_core.adapters import random_lora

    save_file(
        random_lora(model.instance.component("transformer"), ("attn1.to_q", "ffn.net.2"), seed=2),
        tmp_path / "s.safetensors",
    )
    model.instance.adapters.add("look", tmp_path / "s.safetensors")

    def step(sid, rid, prompt, seed, adapters):
        request = model.prepare(
            {"prompt": prompt, "num_frames": 9, "seed": seed, "session_id": sid},
            request_id=rid,
            adapters=adapters,
        )
        return run(model, request)

    styled, plain = model.open_session(), model.open_session()
    step(styled, "s1", "a cat", 1, ["look"])
    step(plain, "p1", "a cat", 1, [])
    with pytest.raises(ConfigError, match=r"session '.*' was started with .*'adapters': 'look@.*Fix: send"):
        step(styled, "s2x", "a dog", 2, [])
    second = step(styled, "s2", "a dog", 2, ["look"])
    assert not torch.equal(second.outputs["latents"], step(plain, "p2", "a dog", 2, []).outputs["latents"])
    assert model.close_session(styled) and model.close_session(plain)
