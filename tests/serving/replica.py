"""A fleet replica in a process of its own, for tests that kill one: ``python -m tests.serving.replica
DEPLOY_JSON REPLICA_ID``; prints ``port <n>`` once it serves, then serves until killed."""

from __future__ import annotations

import json
import sys
import time

from fv_core.deploy.card import parse_deploy
from tests.serving.support import ServerThread, wan_host

START_S = 600  # a loaded machine can take minutes to start many replicas at once


def serve(deploy_file: str, replica: str, tries: int = 3) -> None:
    deploy, host = parse_deploy(json.loads(open(deploy_file).read())), wan_host()
    for attempt in range(tries):
        # its free port was taken meanwhile (many replicas start at once): another port, and another id, since
        # the failed start opened the store (its lease stays with this process)
        server = ServerThread(deploy, host, replica=replica if attempt == 0 else f"{replica}-{attempt}")
        server.thread.start()
        deadline = time.monotonic() + START_S
        while not server.server.started and server.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        if server.server.started:
            break
        if attempt == tries - 1:
            raise RuntimeError(f"replica {replica} did not start")
    print(f"port {server.port}", flush=True)
    while True:
        time.sleep(60)


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2])
