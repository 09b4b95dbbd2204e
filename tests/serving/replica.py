"""A fleet replica in a process of its own, for tests that kill one: ``python -m tests.serving.replica
DEPLOY_JSON REPLICA_ID``; prints ``port <n>`` once it serves, then serves until killed."""

from __future__ import annotations

import json
import sys
import time

from fv_core.deploy.card import parse_deploy
from tests.serving.support import ServerThread, wan_host


def serve(deploy_file: str, replica: str, tries: int = 3) -> None:
    deploy, host = parse_deploy(json.loads(open(deploy_file).read())), wan_host()
    for attempt in range(tries):
        try:
            server = ServerThread(deploy, host, replica=replica).__enter__()
            break
        except RuntimeError:  # its free port was taken meanwhile (many replicas start at once): another
            if attempt == tries - 1:
                raise
    print(f"port {server.port}", flush=True)
    while True:
        time.sleep(60)


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2])
