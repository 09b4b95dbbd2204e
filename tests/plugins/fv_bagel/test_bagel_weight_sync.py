"""Hot weight sync on BAGEL: a ``net`` sync lands between two ticks while a chat, a t2i (CFG rows over
contexts sharing their prefix pages) and a think-t2i (an AR stage handing its KV pages to a denoise
stage) are mid-run.

Requests admitted before it finish bit for bit as on the old weights alone, think-t2i's denoise stage
included (it reads keys/values its AR stage wrote with the old net); those after as on the new weights
alone (references: fresh instances, the new weights loaded with plain ``load_state_dict``). Token steps
and denoise steps batch across requests (the tiny's row-invariant math), so a call shared by old and new
requests would put one of them on the other's weights. The retired net is freed once the last request
pinning it ends, and every KV page comes back. Also: a stage handed keys/values of another net version
refuses them, a ``vae`` sync changes only the decode, bad syncs name the fix, and a push into a served
BAGEL (``POST /v1/weights``) answers the next chat on the new weights.
"""

from __future__ import annotations

import httpx
import pytest
import torch

import fv_core
from fv_core import ConfigError, WeightsError
from fv_core.deploy.card import parse_deploy
from fv_core.loop import LoopContext, LoopRunner
from fv_core.runtime import Engine
from fv_core.training import WeightSyncPlan, push_weights, sync_weights
from fv_core.training.sync import stage_sync
from tests.serving.support import ServerThread

PLAN = WeightSyncPlan(role="student", components=["net"], version="step-1")


@pytest.fixture(scope="module")
def load(bagel_host, bagel_path):
    """A fresh LoadedModel of the tiny card (its own instance), per call."""
    return lambda: fv_core.load("bagel-tiny", bagel_path, host=bagel_host)


def moved(module: torch.nn.Module, seed: int, scale: float) -> dict[str, torch.Tensor]:
    """Every floating tensor of ``module``'s state dict, moved by seeded noise."""
    gen = torch.Generator().manual_seed(seed)
    return {
        k: v + scale * torch.randn(v.shape, generator=gen, dtype=v.dtype)
        for k, v in module.state_dict().items()
        if v.is_floating_point()
    }


@pytest.fixture(scope="module")
def new_net(load):
    return moved(load().instance.component("net"), 0, 0.05)


def ask(model, rid, task, seed, prompt="a red cat", **params):
    """A cheap request: t2i / think-t2i at 3 steps with text CFG (two rows a step), short answers."""
    args = {"prompt": prompt, "seed": seed, **params}
    if task != "chat":
        args.setdefault("num_inference_steps", 3)
    if task != "t2i":
        args.setdefault("max_tokens", 6)
    return model.prepare(args, task=task, request_id=rid)


def solo(model, request):
    with torch.no_grad():
        return Engine().run_one(*model.job(request))


def assert_same(result, ref):
    out, want = result.outputs, ref.outputs
    assert out.keys() == want.keys()
    for name in ("frames", "latents", "tokens"):
        if name in want:
            assert torch.equal(out[name], want[name]), name
    assert out.get("text") == want.get("text")


def test_a_net_sync_mid_run_keeps_each_request_on_its_weights(load, new_net):
    old_ref, new_ref = load(), load()
    new_ref.instance.component("net").load_state_dict(new_net, strict=False)
    live = load()
    inst = live.instance
    old = inst.weights_versions["net"]
    sched = Engine().scheduler(batching=True)
    before = [
        ask(live, "a", "chat", 1, "hello, how are you?", max_tokens=12),
        ask(live, "b", "t2i", 2),
        ask(live, "p", "think-t2i", 3, max_tokens=4),
    ]
    pool = inst.kv_pool
    with torch.no_grad():
        entries = {r.request_id: sched.submit(*live.job(r)) for r in before}
        for _ in range(4):  # prefills, then token / denoise steps
            sched.step()
        assert all(e.phase == "running" for e in entries.values())
        assert entries["p"].stage == 0 and entries["b"].active_loop.state.step >= 1  # think: still AR
        assert pool.used_pages > 0

        staged = stage_sync(live, PLAN, new_net)  # built while the requests wait: nothing live changed
        assert inst.weights_versions["net"] == old and staged.modules["net"] is not inst.component("net")
        swap = sched.at_boundary(staged.apply)
        sched.step()  # the swap, then the tick
        result = swap.result(timeout=0)
        assert result.versions == {"net": "step-1"} and result.previous == {"net": old}
        assert result.pinned == ["a", "b", "p"] and result.tensors == {"net": len(new_net)}
        assert result.cache_entries_dropped == 0  # BAGEL caches nothing across requests
        assert inst.retired_versions == [("net", old)]  # still used by a, b, p
        assert inst.component("net", old) is not inst.component("net")

        after = [
            ask(live, "d", "chat", 1, "hello, how are you?", max_tokens=12),  # = a's request, new weights
            ask(live, "e", "t2i", 2),  # = b's
            ask(live, "q", "think-t2i", 3, max_tokens=4),  # = p's
        ]
        entries.update({r.request_id: sched.submit(*live.job(r)) for r in after})
        denoised_after_swap = 0  # ticks of p's denoise stage, all after the swap
        while sched.has_work():
            sched.step()
            if entries["p"].phase == "running" and entries["p"].stage == 1:
                denoised_after_swap += 1
                # think-t2i's denoise stage started after the swap, on the contexts its AR stage wrote
                # with the old net: it stays on that version, and so the old net stays resident
                assert entries["p"].active_loop.state.values["weights_versions"]["net"] == old
                assert ("net", old) in inst.retired_versions
    assert all(e.error is None for e in entries.values()) and denoised_after_swap >= 1
    assert inst.retired_versions == [] and pool.drain() == 0  # freed once a, b and p finished
    for request in before:
        assert_same(entries[request.request_id].result, solo(old_ref, request))
    for request in after:
        assert_same(entries[request.request_id].result, solo(new_ref, request))
    for a, b in (("a", "d"), ("b", "e"), ("p", "q")):
        ra, rb = entries[a].result.outputs, entries[b].result.outputs
        assert not torch.equal(ra.get("frames", ra.get("tokens")), rb.get("frames", rb.get("tokens")))
    for request in before + after:
        metrics = entries[request.request_id].result.metrics
        assert metrics["weights_versions"]["net"] == (old if request in before else "step-1")
        for stage in metrics.get("stages", {}).values():  # think-t2i: both stages on one version
            assert stage["weights_versions"]["net"] == metrics["weights_versions"]["net"]


def think(live, program, request) -> dict:
    """think-t2i's AR stage run to its end by the runner: its result by stage name (the contexts it hands
    over, and the versions it ran on)."""
    stage = program.stages[0]
    with torch.no_grad():
        result = LoopRunner().run(
            stage.loop, program.stage_request(0, request, {}), live.instance, LoopContext()
        )
    return {stage.name: result}


def test_a_stage_never_reads_keys_values_another_net_version_wrote(load, new_net):
    """think-t2i's AR stage ends, then a sync lands with nothing running: the old net is freed, and the
    denoise stage can neither run on it nor read its keys/values under the new one; the handed-over
    pages come back either way."""
    live = load()
    inst, pool = live.instance, live.instance.kv_pool
    old = inst.weights_versions["net"]
    request = ask(live, "t", "think-t2i", 3, max_tokens=3)
    program = live.runnable("think-t2i")
    image = program.stages[1].loop
    results = think(live, program, request)
    stage = program.stage_request(1, request, results)
    assert {c["net"] for c in stage.carry["contexts"]} == {old}  # the pages name the net that wrote them
    assert stage.carry["weights_versions"]["net"] == old and pool.used_pages > 0
    sync_weights(live, PLAN, new_net)  # nothing running: immediate, the old net freed
    assert inst.retired_versions == [] and inst.weights_versions["net"] == "step-1"
    with pytest.raises(ConfigError, match=rf"weights version '{old}' of 'net' is no longer resident"):
        image.init(stage)
    assert pool.drain() == 0  # the refused stage gave the handed-over pages back

    stage = program.stage_request(1, request, think(live, program, request))  # its AR stage on the new net
    assert {c["net"] for c in stage.carry["contexts"]} == {"step-1"}
    stage.carry["contexts"] = [{**c, "net": old} for c in stage.carry["contexts"]]  # as if old had written
    with pytest.raises(
        ConfigError, match=rf"written by net version '{old}', but this stage runs on 'step-1'"
    ):
        image.init(stage)
    assert pool.drain() == 0


def test_a_vae_sync_changes_only_the_decode(load):
    """The FLUX VAE is its own component: a sync of it leaves the net (and the denoise) alone."""
    live, ref = load(), load()
    request = ask(live, "v", "t2i", 4)
    before = solo(live, request)
    vae = moved(live.instance.component("vae"), 1, 0.02)
    ref.instance.component("vae").load_state_dict(vae, strict=False)
    net = live.instance.weights_versions["net"]
    sync_weights(live, WeightSyncPlan(role="student", components=["vae"], version="vae-1"), vae)
    assert live.instance.weights_versions == {"net": net, "vae": "vae-1"}
    after = solo(live, request)
    assert_same(after, solo(ref, request))
    assert torch.equal(after.outputs["latents"], before.outputs["latents"])
    assert not torch.equal(after.outputs["frames"], before.outputs["frames"])


def test_a_bad_sync_names_the_tensor_the_rule_and_the_fix(load, new_net):
    live = load()
    inst = live.instance
    module, old = inst.component("net"), inst.weights_versions["net"]
    name = "llm2vae.weight"
    with pytest.raises(
        WeightsError,
        match=rf"tensor 'net.{name}' has shape \(3, 3\); the live one has .* a sync keeps the "
        r"architecture. Fix: send weights of the served model's configuration",
    ):
        sync_weights(live, PLAN, {**new_net, name: torch.zeros(3, 3)})
    with pytest.raises(WeightsError, match=r"tensor 'net.no_such.weight' is not in the live component"):
        sync_weights(live, PLAN, {"no_such.weight": torch.zeros(1)})
    with pytest.raises(
        ConfigError, match=r"no weights component 'tokenizer' to sync. Fix: name one of \['net', 'vae'\]"
    ):
        sync_weights(live, PLAN.model_copy(update={"components": ["tokenizer"]}), {"w": torch.zeros(1)})
    with pytest.raises(ConfigError, match=r"already resident"):
        sync_weights(live, PLAN.model_copy(update={"version": old}), new_net)
    assert inst.component("net") is module and inst.weights_versions["net"] == old


def test_a_push_to_a_bagel_server_answers_on_the_new_weights(bagel_host, bagel_path, load, new_net, tmp_path):
    """``POST /v1/weights`` (``push_weights``) into a served BAGEL: the next chat answers as the new
    weights alone do; a tensor of the wrong shape is refused naming it, and changes nothing."""
    ref = load()
    old_text = ref.generate(task="chat", prompt="describe a cat", max_tokens=6, seed=3).text
    ref.instance.component("net").load_state_dict(new_net, strict=False)
    ref.instance.kv_pool.drain()  # changed in place under the same version: its cached prefixes are stale
    want = ref.generate(task="chat", prompt="describe a cat", max_tokens=6, seed=3)
    assert want.text != old_text
    deploy = parse_deploy(
        {
            "plugins": ["fv-bagel"],
            "models": [{"card": "bagel-tiny", "weights": bagel_path}],
            "data_dir": str(tmp_path),
        }
    )
    with ServerThread(deploy, bagel_host, api_key="k") as server:
        live = server.service.models["bagel-tiny"].loaded.instance
        old = live.weights_versions["net"]
        with pytest.raises(ConfigError, match=r"HTTP 400.*tensor 'net.llm2vae.weight' has shape \(3, 3\)"):
            push_weights(server.url, PLAN, {**new_net, "llm2vae.weight": torch.zeros(3, 3)}, api_key="k")
        assert live.weights_versions["net"] == old
        answer = push_weights(server.url, PLAN, new_net, api_key="k")
        assert answer["versions"] == {"net": "step-1"} and answer["previous"] == {"net": old}
        body = {"model": "bagel-tiny", "messages": [{"role": "user", "content": "describe a cat"}]}
        chat = httpx.post(
            f"{server.url}/v1/chat/completions",
            json={**body, "max_tokens": 6, "seed": 3},
            headers={"Authorization": "Bearer k"},
            timeout=120,
        )
        assert chat.status_code == 200, chat.text
        assert chat.json()["choices"][0]["message"]["content"] == want.text
