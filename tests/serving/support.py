"""Shared by the serving tests and benchmarks: a plugin host with fv-wan, a deploy, a server thread."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from typing import Any

from fv_core.deploy.card import DeploymentCard, parse_deploy
from fv_core.plugins import PluginHost, load_plugins
from fv_core.serving.app import create_app
from fv_core.serving.server import DrainingServer

TINY = "wan2.1-t2v-tiny"
SMALL = {"size": "32x32", "extra_body": {"num_frames": 5, "num_inference_steps": 2, "seed": 1}}


def wan_host() -> PluginHost:
    """The installed plugins, fv-wan only."""
    return load_plugins(env={"FV_PLUGINS": "fv-wan"})


def tiny_deploy(data_dir: str | Path, determinism: str = "bitwise", **limits: Any) -> DeploymentCard:
    return parse_deploy(
        {
            "plugins": ["fv-wan"],
            "models": [{"card": TINY}],
            "limits": limits,
            "data_dir": str(data_dir),
            "determinism": determinism,
            # time-sharing: these tests hold several jobs mid-run at once (auto runs the shortest first)
            "scheduling": {"policy": "fair"},
        }
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """A uvicorn server on a free port in a background thread."""

    def __init__(
        self, deploy: DeploymentCard, host: PluginHost, api_key: str | None = None, replica: str | None = None
    ) -> None:
        self.port = free_port()
        self.app = create_app(deploy, host, api_key=api_key, replica=replica)
        self.server = DrainingServer(self.app, host="127.0.0.1", port=self.port, log_level="warning")
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)

    @property
    def service(self):
        return self.app.state.service


def wait_idle(server: ServerThread, timeout: float = 30.0) -> None:
    """Until no job is in flight (deleted jobs leave the engine at their next step boundary)."""
    deadline = time.monotonic() + timeout
    while server.service.live:
        if time.monotonic() > deadline:
            raise AssertionError(f"jobs still in flight: {sorted(server.service.live)}")
        time.sleep(0.02)
