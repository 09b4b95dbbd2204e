"""A fleet replica in a process of its own, for tests that kill one: ``python -m tests.serving.replica
DEPLOY_JSON REPLICA_ID``; prints ``port <n>`` once it serves, then serves until killed."""

from __future__ import annotations

import json
import sys
import time

from fv_core.deploy.card import parse_deploy
from tests.serving.support import ServerThread, wan_host

if __name__ == "__main__":
    deploy = parse_deploy(json.loads(open(sys.argv[1]).read()))
    with ServerThread(deploy, wan_host(), replica=sys.argv[2]) as server:
        print(f"port {server.port}", flush=True)
        while True:
            time.sleep(60)
