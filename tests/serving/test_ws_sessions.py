"""Real-time sessions over ``/v1/sessions/{id}/ws`` on the tiny causal card: a round trip with steering
(PNG and H.264 chunks, a reconnect resuming at the last committed chunk), backpressure (a paused slow
client, a dropping one, neither stalling the others), the interleave gate (sessions steered
concurrently equal each session's chunks replayed alone, bit for bit), admission refusing a frame rate
the instance cannot hold (429 with the predicted numbers), a client that goes away leaving no KV
pages behind, and a server shutting down ending its sessions (the reason, close code 1001, pages freed)."""

from __future__ import annotations

import base64
import io
import json
import signal
import tempfile
import time
from pathlib import Path

import httpx
import imageio.v2 as imageio
import numpy as np
import pytest
import torch
from PIL import Image
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

import fv_core
from fv_core.artifacts import to_uint8
from fv_core.deploy.card import parse_deploy
from fv_core.runtime import Engine
from tests.serving.support import ServerThread

CAUSAL = "wan2.1-t2v-tiny-causal"
FPS = 8  # a chunk of 4 frames every 0.5 s


@pytest.fixture(scope="module")
def server(host, tmp_path_factory):
    """A server of the tiny causal card on its default weights (the tiny checkpoint the other serving
    tests' card shares), bitwise: sessions run their steps apart, so the interleave gate is exact."""
    deploy = parse_deploy(
        {
            "plugins": ["fv-wan"],
            "models": [{"card": CAUSAL}],
            "data_dir": str(tmp_path_factory.mktemp("data")),
            "determinism": "bitwise",
        }
    )
    with ServerThread(deploy, host) as srv:
        yield srv


@pytest.fixture(autouse=True)
def unmeasured(server):
    """Each test starts with the chunk cost unmeasured, so admission holds every session it opens (on a
    busy shared CPU the measured cost would refuse some; the admission test measures its own)."""
    server.service.realtime.solo_s.clear()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def open_session(http, **body) -> str:
    answer = http.post("/v1/sessions", json={"fps": FPS, "prompt": "a red circle", **body})
    assert answer.status_code == 200, answer.text
    return answer.json()["id"]


def socket(server, sid: str, **query):
    url = server.url.replace("http", "ws") + f"/v1/sessions/{sid}/ws"
    return connect(url + ("?" + "&".join(f"{k}={v}" for k, v in query.items()) if query else ""))


def receive(ws, timeout: float = 30.0) -> dict:
    return json.loads(ws.recv(timeout=timeout))


def chunks(ws, n: int) -> list[dict]:
    out = [receive(ws) for _ in range(n)]
    assert all(m["type"] == "chunk" for m in out), out
    return out


def png_frames(message: dict) -> np.ndarray:
    return np.stack([np.asarray(Image.open(io.BytesIO(base64.b64decode(f)))) for f in message["data"]])


def pool(server):
    return server.service.models[CAUSAL].loaded.instance.kv_pool


def error(ws, made: list[dict]) -> str:
    """The next error message (chunks arriving meanwhile go to ``made``)."""
    while (message := receive(ws))["type"] == "chunk":
        made.append(message)
    assert message["type"] == "error", message
    return message["message"]


def stop(ws, seen: list[dict] | None = None) -> dict:
    """Stop the session; its end message (chunks committed before the stop took effect go to ``seen``)."""
    ws.send(json.dumps({"type": "stop"}))
    while (message := receive(ws))["type"] != "end":
        (seen if seen is not None else []).append(message)
    return message


def test_steering_png_and_h264_chunks_and_a_reconnect_resuming_at_the_last_committed_chunk(server, http):
    sid = open_session(http, seed=5)
    with socket(server, sid) as ws:
        hello = receive(ws)
        assert hello["type"] == "session" and hello["fps"] == FPS and hello["format"] == "png"
        first = chunks(ws, 2)
        assert [(m["chunk"], m["first_frame"], m["frames"]) for m in first] == [(0, 0, 1), (1, 1, 4)]
        assert png_frames(first[1]).shape == (4, 32, 32, 3) and first[1]["prompt"] == "a red circle"
        ws.send(json.dumps({"type": "steer", "prompt": "a blue square", "strength": 0.5}))
        ws.send(json.dumps({"type": "steer", "strength": 2}))
        made: list[dict] = []
        assert "strength=2" in error(ws, made)  # refused, naming the rule; the session goes on
        ws.send(json.dumps({"type": "steer", "prompt": ""}))
        assert "a steer's prompt is a non-empty string" in error(ws, made)
        ws.send("louder")
        assert "is not one of steer / ack / stop" in error(ws, made)
        made += chunks(ws, max(0, 2 - len(made)))
        steered = made[1]  # chunk 3: steered at the latest (chunk 2 may have been in flight)
        assert (steered["prompt"], steered["strength"], steered["steer_from"]) == (
            "a blue square",
            0.5,
            "a red circle",
        )
    record = http.get(f"/v1/sessions/{sid}").json()
    assert record["chunks"] >= 4 and record["kv_bytes"] > 0 and record["first_frame_s"] > 0
    [listed] = [s for s in http.get("/v1/sessions").json()["data"] if s["id"] == sid]  # where it lives
    assert (listed["kind"], listed["status"], listed["replica"]) == ("realtime", "open", record["replica"])
    assert listed["chunks"] >= 4
    with socket(server, sid, format="h264") as ws:
        hello = receive(ws)
        again = receive(ws)  # the last committed chunk first, then the session goes on from it
        assert again["chunk"] == hello["chunks"] - 1 and again["format"] == "h264"
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "chunk.mp4"
            path.write_bytes(base64.b64decode(again["data"]))
            assert np.stack(imageio.mimread(path)).shape == (4, 32, 32, 3)
        following = receive(ws)
        assert (
            following["chunk"] == again["chunk"] + 1 and following["first_frame"] == again["first_frame"] + 4
        )
        seen = [following]
        end = stop(ws, seen)
    assert end["reason"] == "stopped by the client" and end["chunks"] == seen[-1]["chunk"] + 1
    assert http.get(f"/v1/sessions/{sid}").status_code == 404


def test_a_slow_client_pauses_or_drops_and_never_stalls_the_others(server, http):
    paused, dropping, other = open_session(http), open_session(http), open_session(http)
    with (
        socket(server, paused, policy="pause", window=1) as slow,
        socket(server, dropping, policy="drop", window=1) as lossy,
        socket(server, other) as fast,
    ):
        for ws in (slow, lossy, fast):
            receive(ws)
        assert chunks(slow, 1)[0]["chunk"] == 0 and chunks(lossy, 1)[0]["chunk"] == 0  # then no acks
        assert [m["chunk"] for m in chunks(fast, 5)] == [0, 1, 2, 3, 4]  # the others go on
        records = {sid: http.get(f"/v1/sessions/{sid}").json() for sid in (paused, dropping)}
        assert records[paused]["chunks"] == 1  # paused until its client takes what it was sent
        assert records[dropping]["chunks"] >= 3  # goes on; its client gets the newest when it can
        slow.send(json.dumps({"type": "ack"}))
        assert chunks(slow, 1)[0]["chunk"] == 1  # resumes where it paused
        lossy.send(json.dumps({"type": "ack"}))
        newest = chunks(lossy, 1)[0]["chunk"]
        assert newest >= 2 and http.get(f"/v1/sessions/{dropping}").json()["dropped_chunks"] >= 1
        for ws in (slow, lossy, fast):
            stop(ws)


def replay(model, messages: list[dict], seed: int) -> list[np.ndarray]:
    """The session's chunks made one after another alone, each as the server reports it was asked."""
    sid, frames = model.open_session(), []
    with torch.inference_mode():
        for m in messages:
            raw = {"prompt": m["prompt"], "seed": seed + m["chunk"], "num_frames": 1, "session_id": sid}
            if m["strength"] < 1:
                raw.update(steer_from=m["steer_from"], steer_strength=m["strength"])
            result = Engine().run_one(*model.job(model.prepare(raw, request_id=f"replay-{m['chunk']}")))
            frames.append(to_uint8(result.outputs["frames"].float().numpy()))
    model.close_session(sid)
    return frames


def test_interleave_gate_sessions_steered_concurrently_equal_their_chunks_replayed_alone(server, http, host):
    seeds = {"a": 11, "b": 22}
    sids = {k: open_session(http, seed=s, prompt=f"prompt {k}") for k, s in seeds.items()}
    got: dict[str, list[dict]] = {}
    with socket(server, sids["a"]) as a, socket(server, sids["b"]) as b:
        receive(a), receive(b)
        got = {"a": chunks(a, 1), "b": chunks(b, 1)}
        a.send(json.dumps({"type": "steer", "prompt": "a turns green", "strength": 0.5}))
        b.send(json.dumps({"type": "steer", "prompt": "b turns blue"}))
        got["a"] += chunks(a, 2)
        got["b"] += chunks(b, 2)
        stop(a), stop(b)
    assert any(m["prompt"] == "a turns green" and m["strength"] == 0.5 for m in got["a"])
    assert any(m["prompt"] == "b turns blue" for m in got["b"])
    model = fv_core.load(CAUSAL, host=host)
    for k, messages in got.items():
        for m, alone in zip(messages, replay(model, messages, seeds[k]), strict=True):
            assert np.array_equal(png_frames(m), alone), f"session {k} chunk {m['chunk']}"


def test_admission_refuses_a_frame_rate_it_cannot_hold_and_a_gone_client_leaves_no_pages(server, http):
    sid = open_session(http, linger_s=0.3)
    with socket(server, sid) as ws:
        receive(ws)
        chunks(ws, 3)  # chunks made alone: the instance's chunk cost is measured
        metrics = http.get("/metrics").text
        assert f'fv_realtime_deadline_misses_total{{model="{CAUSAL}",session="{sid}"}}' in metrics
        refused = http.post("/v1/sessions", json={"fps": 240, "prompt": "too fast"})
        assert refused.status_code == 429
        error = refused.json()["error"]
        assert error["code"] == "deadline_infeasible" and error["param"] == "fps"
        assert (
            "fps=240 cannot be held: with 1 session(s) already held, 2 sessions predict" in error["message"]
        )
        assert "Fix: ask for fps <=" in error["message"]
    deadline = time.monotonic() + 10  # the client went away: after linger_s the session ends
    while http.get(f"/v1/sessions/{sid}").status_code != 404:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert pool(server).used_pages == 0 and pool(server).reserved_pages == 0
    with socket(server, sid) as ws:
        assert "no real-time session" in receive(ws)["message"]
    bad = http.post("/v1/sessions", json={"fps": 4, "prompt": "x", "params": {"height": 33}})
    assert bad.status_code == 400 and "height=33" in bad.json()["error"]["message"]


def test_shutdown_ends_each_session_with_its_reason_closes_the_socket_and_frees_the_pages(host, tmp_path):
    deploy = parse_deploy({"plugins": ["fv-wan"], "models": [{"card": CAUSAL}], "data_dir": str(tmp_path)})
    with ServerThread(deploy, host) as srv:
        with httpx.Client(base_url=srv.url, timeout=60) as client:
            sid = open_session(client)
        with socket(srv, sid) as ws:
            receive(ws)
            chunks(ws, 1)
            srv.server.handle_exit(signal.SIGTERM, None)  # what `fv serve` does on SIGTERM: drain, then exit
            while (message := receive(ws))["type"] == "chunk":
                pass
            assert message["type"] == "end" and message["reason"] == "the server is shutting down"
            with pytest.raises(ConnectionClosed) as closed:
                ws.recv(timeout=10)
            assert closed.value.rcvd is not None
            assert (closed.value.rcvd.code, closed.value.rcvd.reason) == (1001, "the server is shutting down")
        assert pool(srv).used_pages == 0 and pool(srv).reserved_pages == 0
        srv.thread.join(30)
        assert not srv.thread.is_alive()  # the drain ended: the server exited
