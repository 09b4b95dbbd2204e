"""``fv serve DEPLOY_FILE`` or ``fv serve MODEL [--weights DIR]``: the HTTP server on uvicorn;
``fv serve --ray DEPLOY_FILE``: the fleet a plugin registers as ``"ray"`` (fv-ray-serve: Ray Serve)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fv_core.deploy.card import DeploymentCard
    from fv_core.plugins import PluginHost

DEPLOY_SUFFIXES = (".yaml", ".yml", ".json")
SERVE_EXTRA = 'fv serve needs the serve extra. Fix: pip install -e ".[serve]" (in this repository)'


def cmd_serve(args: argparse.Namespace) -> int:
    from fv_core.devices import check_device
    from fv_core.errors import ConfigError
    from fv_core.plugins import load_plugins

    check_device(args.device, "--device")  # before any process or model starts
    if args.ray and args.parallel:
        raise ConfigError(
            "--parallel with --ray: put `parallel:` on the deploy entry instead (each replica reads it)."
        )
    if args.ray:  # a plugin's fleet (fv-ray-serve registers "ray")
        if not is_deploy_file(args.deploy_file):
            raise ConfigError(
                f"fv serve --ray {args.deploy_file}: a fleet is served from a deploy file (a .yaml, .yml or "
                "a .json that exists), with its `fleet:` section. Fix: write one (see examples/deploy/fleet.yaml) "
                "and pass its path, or drop --ray to serve this model in one process."
            )
        return load_plugins().fleet("ray")(
            args.deploy_file,
            host=args.host,
            port=args.port,
            data_dir=args.data_dir,
            api_key=args.api_key,
            device=args.device,
            address=args.ray_address,
        )
    try:
        from fv_core.serving.server import DrainingServer
    except ImportError:
        raise ConfigError(SERVE_EXTRA) from None

    from fv_core.deploy import check_deploy
    from fv_core.serving.app import create_app

    host = load_plugins()
    deploy = with_parallel(served_deploy(host, args.deploy_file, args.weights), args.parallel)
    problems = check_deploy(deploy, host, args.device)
    if problems:
        raise ConfigError(
            f"{args.deploy_file}: invalid deployment:\n" + "\n".join(f"  - {p}" for p in problems)
        )
    app = create_app(deploy, host, args.data_dir, args.api_key, args.device)
    DrainingServer(app, host=args.host, port=args.port, log_level=args.log_level).run()
    return 0


def is_deploy_file(target: str) -> bool:
    return target.lower().endswith(DEPLOY_SUFFIXES) and Path(target).is_file()


def served_deploy(host: PluginHost, target: str, weights: str | None) -> DeploymentCard:
    """The deploy file ``target``, or a deployment of the one model ``target`` (a card id) on ``weights``
    enabling the plugins its card needs, with the default limits."""
    from fv_core.deploy import load_deploy
    from fv_core.errors import ConfigError
    from fv_core.hub import is_repo_id
    from fv_core.replay import one_model_deploy

    if target.lower().endswith(DEPLOY_SUFFIXES):
        if weights is not None:
            raise ConfigError(
                f"--weights {weights} with the deploy file {target}: a deploy file names each model's weights. "
                "Fix: set `weights:` on the model's entry, or serve a model: fv serve CARD --weights DIR."
            )
        return load_deploy(target)  # a missing file is an error naming it
    if target in host.registries.cards:
        return one_model_deploy(host, target, weights, limits={})
    if Path(target).expanduser().is_dir() or is_repo_id(target):
        return checkpoint_deploy(host, target, weights)
    cards = sorted(str(k) for k in host.registries.cards)
    raise ConfigError(
        f"fv serve {target}: neither a deploy file (a .yaml, .yml or .json that exists), a registered card "
        f"(cards: {cards}), a checkpoint folder nor a Hugging Face repo id (owner/name). Fix: pass a card id "
        "(see `fv cards`), the path of a deploy file or of a checkpoint folder, or a repo id."
    )


def checkpoint_deploy(host: PluginHost, target: str, weights: str | None) -> DeploymentCard:
    """A deployment of the checkpoint ``target`` (a folder, or a Hugging Face repo id fetched here) served
    by that name, its card built from its configs as ``fv generate --weights`` builds it, enabling the
    plugin that reads it, with the default limits."""
    from fv_core.deploy.card import DeploymentCard, ModelDeploy
    from fv_core.deploy.check import checkpoint_plugin
    from fv_core.errors import ConfigError
    from fv_core.hub import folder_snapshot, is_repo_id

    if weights is not None:
        raise ConfigError(
            f"fv serve {target} --weights {weights}: {target} is a checkpoint already, its card built from its "
            f"configs. Fix: fv serve {target}, or fv serve CARD --weights {weights} (cards: `fv cards`)."
        )
    folder = folder_snapshot(target).folder if is_repo_id(target) else Path(target).expanduser().resolve()
    plugin = checkpoint_plugin(host, folder, f"fv serve {target}")
    return DeploymentCard(plugins=[plugin], models=[ModelDeploy(card=target)])


def with_parallel(deploy: DeploymentCard, plan: str | None) -> DeploymentCard:
    """``deploy`` with its one model on parallel ``plan`` (``--parallel``); unchanged without one."""
    from fv_core.errors import ConfigError
    from fv_core.parallel import ParallelPlan

    if plan is None:
        return deploy
    if len(deploy.models) != 1:
        names = [m.served_name for m in deploy.models]
        raise ConfigError(
            f"--parallel {plan}: the deploy file serves {len(deploy.models)} models {names}, and a process runs "
            "one parallel group. Fix: set `parallel:` on one model's entry in the deploy file."
        )
    entry = deploy.models[0].model_copy(update={"parallel": ParallelPlan.parse(plan).id})
    return deploy.model_copy(update={"models": [entry]})


def add_serve_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add ``serve`` to the ``fv`` command's subparsers."""
    serve = subparsers.add_parser(
        "serve", help="serve a deploy file, or one model, over an OpenAI-compatible HTTP API"
    )
    serve.add_argument(
        "deploy_file",
        metavar="MODEL|DEPLOY_FILE",
        help="a card id (see `fv cards`), or a deploy file (.yaml, .yml or .json)",
    )
    serve.add_argument(
        "--weights",
        metavar="DIR|ID",
        help="MODEL's checkpoint folder or Hugging Face id, OWNER/NAME[@REVISION] (default: the card's "
        "embedded weights, else its published repo)",
    )
    serve.add_argument(
        "--ray",
        action="store_true",
        help="serve a fleet on Ray Serve: replicas per model from the deploy file's fleet: section "
        "(needs fv-ray-serve)",
    )
    serve.add_argument(
        "--ray-address", default=None, help="Ray cluster to join (default: $RAY_ADDRESS, else a local one)"
    )
    serve.add_argument("--host", default="127.0.0.1", help="interface to bind (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    serve.add_argument(
        "--api-key",
        default=os.environ.get("FV_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1 (default: $FV_API_KEY; unset: no key)",
    )
    serve.add_argument(
        "--data-dir", default=None, help="jobs database and videos (default: the deploy's data_dir)"
    )
    serve.add_argument(
        "--parallel",
        metavar="PLAN",
        help="run the deploy file's one model on a group of processes, e.g. sp=2,cfg=2 (default: its entry's)",
    )
    serve.add_argument("--device", default="cpu", help="torch device the models run on (default: cpu)")
    serve.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    serve.set_defaults(func=cmd_serve)
