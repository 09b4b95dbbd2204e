"""The deploy file's fleet: section and the queue-depth autoscaling policy (no cluster needed)."""

from __future__ import annotations

import pytest
from ray.serve.config import AutoscalingContext

from fv_core import ConfigError
from fv_ray_serve import QUEUE_DEPTH, QueueDepthPolicy, applications, split_fleet

BASE = {
    "plugins": ["fv-wan"],
    "models": [{"card": "wan2.1-t2v-tiny"}, {"card": "wan2.1-t2v-tiny", "name": "b"}],
}


@pytest.mark.parametrize(
    ("fleet", "says"),
    [
        ({"models": {"b": {"replicas": 2, "max_replicas": 4}}}, "replicas=2 and max_replicas=4 are both set"),
        ({"models": {"b": {"min_replicas": 3, "max_replicas": 2}}}, "set max_replicas >= 3"),
        ({"models": {"b": {"replicas": 0}}}, "models.b.replicas"),
        ({"models": {"b": {"target_queue_depth": 0}}}, "target_queue_depth"),
        ({"models": {"nope": {"replicas": 2}}}, "names ['nope'], which the deploy file does not serve"),
        ({"replicas": 2}, "unknown field"),
    ],
)
def test_bad_fleet_sections_name_the_value_the_rule_and_the_fix(fleet, says):
    with pytest.raises(ConfigError, match="Fix") as err:
        split_fleet({**BASE, "fleet": fleet}, "deploy.yaml")
    assert says in str(err.value) and "deploy.yaml" in str(err.value)


def test_one_application_per_model_fixed_or_autoscaled_on_queue_depth(tmp_path):
    fleet = {"models": {"b": {"min_replicas": 1, "max_replicas": 3, "target_queue_depth": 2}}}
    deploy, scale = split_fleet({**BASE, "data_dir": str(tmp_path), "fleet": fleet})
    apps = applications(deploy, scale)
    assert [(name, prefix) for name, _, prefix in apps] == [
        ("wan2.1-t2v-tiny", "/wan2.1-t2v-tiny"),
        ("b", "/b"),
    ]
    fixed, auto = (app._bound_deployment for _, app, _ in apps)
    assert fixed.num_replicas == 1 and fixed._deployment_config.autoscaling_config is None
    config = auto._deployment_config.autoscaling_config
    assert (config.min_replicas, config.max_replicas) == (1, 3)
    assert config.policy.policy_kwargs == {"target_queue_depth": 2}


def _context(depths: dict[str, float] | None, current: int = 2) -> AutoscalingContext:
    return AutoscalingContext(
        deployment_id=None, deployment_name="m", app_name="m", current_num_replicas=current,
        target_num_replicas=current, running_replicas=[], total_num_requests=0.0, total_queued_requests=1.0,
        aggregated_metrics={QUEUE_DEPTH: depths} if depths is not None else {}, raw_metrics={},
        capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=8, policy_state={},
        last_scale_up_time=None, last_scale_down_time=None, current_time=None, config=None,
    )  # fmt: skip


def test_the_policy_sizes_the_deployment_from_the_replicas_queue_depth():
    policy = QueueDepthPolicy(target_queue_depth=4)
    assert policy(_context({"r1": 9.0, "r2": 6.0}))[0] == 4  # (9 + 6 + 1 waiting request) / 4
    assert policy(_context({"r1": 0.0, "r2": 0.0}))[0] == 1  # only the waiting request
    assert policy(_context(None, current=3))[0] == 3  # no report yet: unchanged


def test_fv_serve_takes_ray_and_a_cluster_address():
    import argparse

    from fv_core.serving.cli import add_serve_parser

    parser = argparse.ArgumentParser(prog="fv")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["serve", "--ray", "d.yaml", "--ray-address", "auto"])
    assert (args.ray, args.ray_address, args.deploy_file) == (True, "auto", "d.yaml")
    assert parser.parse_args(["serve", "d.yaml"]).ray is False


def test_serve_run_builds_one_models_application_from_a_deploy_file(tmp_path):
    import yaml

    from fv_ray_serve import app_builder

    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump({**BASE, "fleet": {"models": {"b": {"replicas": 3}}}}))
    assert app_builder({"deploy": str(path), "model": "b"})._bound_deployment.num_replicas == 3
    with pytest.raises(ValueError, match="Fix: pass model=NAME"):
        app_builder({"deploy": str(path)})  # two models: serve run needs one


def test_fv_serve_ray_runs_the_fleet_the_plugin_registers_without_importing_ray_to_load_it():
    import subprocess
    import sys

    from fv_core.plugins import load_plugins
    from fv_ray_serve.run import run_fleet

    assert load_plugins().fleet("ray") is run_fleet
    check = "import sys; from fv_core.plugins import load_plugins; load_plugins(); assert 'ray' not in sys.modules"
    subprocess.run([sys.executable, "-c", check], check=True)
