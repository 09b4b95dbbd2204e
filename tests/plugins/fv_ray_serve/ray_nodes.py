"""A Ray cluster of two nodes on this machine, each started with ``ray start --block`` (a head and a
worker, one CPU each, every port of their own), stopped by ending exactly those two commands."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.serving.support import free_port


def _ports() -> list[str]:
    names = ("node-manager", "object-manager", "dashboard-agent-listen", "dashboard-agent-grpc",
             "runtime-env-agent", "metrics-export")  # fmt: skip
    return [f"--{name}-port={free_port()}" for name in names]


class RayNodes:
    """``with RayNodes(env) as nodes: ray.init(address=nodes.address)``; ``env`` reaches every worker."""

    def __init__(self, env: dict[str, str]) -> None:
        # no token auth: a driver process whose ray module was imported before cannot switch it on (its
        # config is read at import), and this cluster lives for one test module
        self.env = {**os.environ, **env, "RAY_AUTH_MODE": "disabled"}
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.temp = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))  # short: Ray's socket paths are capped
        self.procs: list[subprocess.Popen] = []

    def _start(self, *args: str) -> None:
        ray = str(Path(sys.executable).parent / "ray")
        command = [ray, "start", "--block", "--num-cpus=1", "--disable-usage-stats", *_ports(), *args]
        self.procs.append(
            subprocess.Popen(command, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        )

    def __enter__(self) -> RayNodes:
        try:
            return self._up()
        except BaseException:
            self.__exit__()
            raise

    def _up(self) -> RayNodes:
        import ray

        self._start("--head", f"--port={self.port}", "--include-dashboard=false", f"--temp-dir={self.temp}",
                    f"--ray-client-server-port={free_port()}")  # fmt: skip
        deadline = time.monotonic() + 120
        while not self._listening():  # the head's GCS answers: the worker joins it
            if self.procs[0].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the Ray head node did not start")
            time.sleep(0.5)
        self._start(f"--address={self.address}")
        ray.init(address=self.address, log_to_driver=False)
        while len([n for n in ray.nodes() if n["Alive"]]) < 2:
            if self.procs[1].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the Ray worker node did not join the head")
            time.sleep(0.5)
        return self

    def _listening(self) -> bool:
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
            return True
        except OSError:
            return False

    def __exit__(self, *exc: object) -> None:
        import ray

        ray.shutdown()
        for proc in reversed(self.procs):  # `ray start --block` stops its node's processes on SIGTERM
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(self.temp, ignore_errors=True)
