"""What every family needs lives in the core once: pinning and the batch key, the Params check, the
kernels a card accepts."""

from types import SimpleNamespace

import pytest
import torch

from fv_core import CardValidationError, ConfigError
from fv_core.card import validate_card
from fv_core.load import resolve_kernels
from fv_core.loop import LoopState, batch_key, pinned, pinned_module, pinned_state
from fv_core.request import Params, Request
from fv_core.runtime import Engine
from tests.core.conftest import make_card
from tests.runtime.synthetic import NullLoop


class Instance:
    """The little a pinned loop asks of an instance: an id, live versions, components by version."""

    instance_id = "toy#0"

    def __init__(self) -> None:
        self.weights_versions = {"dit": "v1", "vae": "a"}
        self.card = make_card()

    def component(self, name: str, version: str | None = None) -> str:
        return f"{name}@{version or 'live'}"


def request(rid: str = "r", carry: dict | None = None, params: object = None) -> Request:
    return Request(rid, task="t2v", params=Params(seed=7) if params is None else params, carry=carry or {})


def test_a_request_is_pinned_to_the_live_versions_or_to_what_its_first_stage_pinned():
    inst = Instance()
    state = pinned_state(request(), inst, "denoise", total_steps=3)
    assert state.values["weights_versions"] == {"dit": "v1", "vae": "a"} and state.total_steps == 3
    assert torch.equal(
        torch.randn(4, generator=state.generator), torch.randn(4, generator=torch.manual_seed(7))
    )
    inst.weights_versions["dit"] = "v2"  # a weight sync lands: the running request stays on v1
    assert pinned(state, "dit") == "v1" and pinned_module(inst, state, "dit") == "dit@v1"
    assert pinned(state, "tokenizer") is None and pinned_module(inst, state, "tokenizer") == "tokenizer@live"
    later = pinned_state(request(carry={"weights_versions": {"dit": "v1"}}), inst, "refine")
    assert pinned(later, "dit") == "v1", "a later stage runs on what the first stage pinned"


def test_plans_on_other_versions_never_share_a_batch_key():
    inst = Instance()
    old = pinned_state(request("a"), inst, "denoise")
    also_old = pinned_state(request("b"), inst, "denoise")
    inst.weights_versions["dit"] = "v2"
    new = pinned_state(request("c"), inst, "denoise")

    def key(state: LoopState, components=("dit",)):
        return batch_key(inst, state, components, "denoise", (4, 8), "float32")

    assert key(old) == key(also_old)
    assert key(old) != key(new)
    assert key(old, ("vae",)) == key(new, ("vae",)), "only the components a plan runs split it"
    also_old.values["adapter_versions"] = {"style": "s1"}
    assert key(old) == key(also_old), "adapters are applied per row: they never split a batch"


class OneStep(NullLoop):
    def init(self, request, instance, ctx) -> LoopState:
        return LoopState(request.request_id, self.loop_id, total_steps=1)


def test_the_scheduler_checks_a_requests_params_once_at_intake():
    inst = SimpleNamespace(card=make_card())
    scheduler = Engine().scheduler(batching=False)
    with pytest.raises(ConfigError, match=r"carries dict params, not Params\. Fix: build requests with"):
        scheduler.submit(OneStep(), Request("bad", task="t2v", params={"steps": 1}), inst)
    assert "bad" not in scheduler.entries
    entry = scheduler.submit(OneStep(), Request("ok", task="t2v", params=Params()), inst)
    assert entry.request_id in scheduler.entries


def test_a_card_declares_the_kernels_its_model_code_runs(host):
    host.collect()
    card = make_card()  # accepts attention sdpa only (the default)
    host.registries.kernels.register(("attention", "cpu", "any", "naive"), "torch.nn.functional:linear", "ex")
    with pytest.raises(ConfigError) as err:
        resolve_kernels(host, card, "cpu", requested={"attention": "naive"})
    assert "attention='naive'" in str(err.value) and "['sdpa']" in str(err.value) and "Fix:" in str(err.value)
    with pytest.raises(ConfigError, match="accepts no 'vae_tile' kernel"):
        resolve_kernels(host, card, "cpu", requested={"vae_tile": "naive"})
    with pytest.raises(CardValidationError, match="kernels.attention"):
        validate_card(make_card(kernels={"attention": "naive"}))
    assert make_card(accepts_kernels={"attention": ["*"]}).accepts_kernel("attention", "naive")
