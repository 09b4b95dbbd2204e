"""``fv serve --ray DEPLOY_FILE``: the fleet on a Ray cluster, until Ctrl-C / SIGTERM."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from pathlib import Path

from fv_core import ConfigError
from fv_core.deploy import check_deploy
from fv_core.plugins import load_plugins
from fv_ray_serve.affinity import NAMESPACE, directory_name
from fv_ray_serve.config import load_fleet_file
from fv_ray_serve.deployment import applications

log = logging.getLogger("fv.serving")


def run_fleet(
    deploy_file: str | Path,
    host: str = "127.0.0.1",
    port: int = 8000,
    data_dir: str | None = None,
    api_key: str | None = None,
    device: str = "cpu",
    address: str | None = None,
) -> int:
    """Start (or join, ``address`` / ``$RAY_ADDRESS``) a Ray cluster, run one Serve application per
    served model behind Serve's HTTP proxy on ``host:port``, and stop them on the first exit signal
    (each replica drains: running jobs get the deploy's ``shutdown_grace_s``)."""
    import ray

    deploy, fleet = load_fleet_file(deploy_file)
    problems = check_deploy(deploy, load_plugins(), device)
    if problems:
        raise ConfigError(f"{deploy_file}: invalid deployment:\n" + "\n".join(f"  - {p}" for p in problems))
    from ray import serve

    ray.init(address=address)
    serve.start(http_options={"host": host, "port": port})
    names = []
    for name, app, prefix in applications(deploy, fleet, data_dir, api_key, device):
        serve.run(app, name=name, route_prefix=prefix, blocking=False)
        names.append(name)
        log.warning("fleet: model %r at http://%s:%d%s", name, host, port, prefix.rstrip("/") + "/v1")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    for name in names:
        serve.delete(name)
        with contextlib.suppress(ValueError):  # the application's session directory (none: no session)
            ray.kill(ray.get_actor(directory_name(name), namespace=NAMESPACE))
    serve.shutdown()
    ray.shutdown()
    return 0
