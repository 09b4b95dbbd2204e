"""fv-train-flow registers its methods, option schema, reward and scorer, workflow, dataset and commands
through the hooks."""

from fv_core.plugins import PluginHost
from fv_train_flow import plugin, shapes
from fv_train_flow.config import FlowOptions
from fv_train_flow.method import FlowMethod
from fv_train_flow.reward import ShapesDetectorReward
from fv_train_flow.vae import VaeMethod


def test_methods_and_options_are_registered():
    host = PluginHost({})
    host.add(plugin, "fv-train-flow")
    host.collect()
    assert host.infos["fv-train-flow"].hooks == [
        "fv_register_commands",
        "fv_register_datasets",
        "fv_register_methods",
        "fv_register_options",
        "fv_register_rewards",
        "fv_register_scorers",
        "fv_register_workflows",
    ]
    assert host.registries.methods.get("flow") is FlowMethod
    assert host.registries.methods.get("vae") is VaeMethod
    assert host.registries.options.get("fv-train-flow") is FlowOptions
    assert host.registries.rewards.get("shapes-detector") is ShapesDetectorReward
    assert host.registries.scorers.get("shapes-detector") is ShapesDetectorReward
    assert host.registries.workflows.get("shapes-best-of-n")["stages"][0]["select"] == "shapes-detector"
    video, captions = host.registries.datasets.get("shapes")().batch(0, 5, 2)
    assert video.shape == (2, 3, 9, 64, 64) and captions == [s.caption for s in shapes.stream_specs(0, 5, 2)]
    assert set(host.registries.commands) == {"eval"}  # `fv train` is the core's
