"""``fv dynamo-worker DEPLOY_FILE``: the deploy file's models as one Dynamo worker, until Ctrl-C / SIGTERM.

Dynamo's frontend runs beside it (``python -m dynamo.frontend``); both find etcd and NATS through
Dynamo's own settings (``ETCD_ENDPOINTS``, ``NATS_SERVER``, ``DYN_REQUEST_PLANE``, ...).
"""

from __future__ import annotations

import argparse
import os


def add_worker_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "dynamo-worker", help="serve a deploy file's models as an NVIDIA Dynamo worker (fv-dynamo)"
    )
    p.add_argument("deploy_file", help="deploy file (.yaml, .yml or .json)")
    p.add_argument("--namespace", default="fv", help="Dynamo namespace to register in (default: fv)")
    p.add_argument("--device", default="cpu", help="torch device the models run on (default: cpu)")
    p.add_argument("--data-dir", default=None, help="jobs database and videos (default: the deploy's)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("FV_API_KEY"),
        help="the worker's fv server requires it (default: $FV_API_KEY; unset: no key)",
    )
    p.add_argument("--http-host", default="127.0.0.1", help="the worker's fv server interface")
    p.add_argument("--http-port", type=int, default=0, help="the worker's fv server port (default: free)")
    p.add_argument(
        "--public-url", default=None, help="where clients reach that server (video url answers; default: it)"
    )
    p.set_defaults(func=cmd_worker)
    return p


def cmd_worker(args: argparse.Namespace) -> int:
    import uvloop
    from dynamo.runtime import dynamo_worker

    from fv_core import ConfigError
    from fv_core.deploy import check_deploy, load_deploy
    from fv_core.plugins import load_plugins
    from fv_dynamo.worker import serve_worker

    host = load_plugins()
    deploy = load_deploy(args.deploy_file)
    problems = check_deploy(deploy, host, args.device)
    if problems:
        raise ConfigError(
            f"{args.deploy_file}: invalid deployment:\n" + "\n".join(f"  - {p}" for p in problems)
        )

    @dynamo_worker()
    async def worker(runtime: object) -> None:
        await serve_worker(
            runtime,
            deploy,
            host,
            namespace=args.namespace,
            data_dir=args.data_dir,
            api_key=args.api_key,
            device=args.device,
            http_host=args.http_host,
            http_port=args.http_port,
            public_url=args.public_url,
            on_ready=lambda url: print(f"fv-dynamo: ready, fv server at {url}", flush=True),
        )

    uvloop.run(worker())
    return 0
