"""LoRA adapters per request on Wan: C1 against diffusers' ``load_lora_weights`` + ``set_adapters`` on the
same weights and seed, a converted (original Wan) format, two combined, a text-encoder LoRA against PEFT
on diffusers' text encoder, requests with different adapters (and none) in one batched call, cache keys
partitioned by adapter, and every bad input refused clearly."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from wan_support import BASE, NEGATIVE, PROMPT, front, tiny_instance

from fv_core import ConfigError
from fv_core.adapters import AdapterPlane, read_lora
from fv_core.adapters.plane import attach_plane
from fv_core.runtime import Engine
from fv_core.runtime.policy import SchedulingPolicy
from fv_wan.t2v_loop import WanLoop

SMALL = dict(num_frames=5, height=32, width=48, num_inference_steps=3, guidance_scale=5.0)
TARGETS = ("attn1.to_q", "attn1.to_v", "attn2.to_k", "attn2.to_out.0", "ffn.net.0.proj", "ffn.net.2")


def lora_pairs(model: torch.nn.Module, seed: int, rank: int = 4, prefix: str = "transformer") -> dict:
    """A random LoRA on every block's TARGETS, keyed as diffusers saves them (``lora_A/B.weight``)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, _ in enumerate(model.blocks):
        for name in TARGETS:
            linear = model.get_submodule(f"blocks.{i}.{name}")
            out[f"{prefix}.blocks.{i}.{name}.lora_A.weight"] = (
                torch.randn(rank, linear.in_features, generator=g) * 0.3
            )
            out[f"{prefix}.blocks.{i}.{name}.lora_B.weight"] = (
                torch.randn(linear.out_features, rank, generator=g) * 0.3
            )
    return out


@pytest.fixture(scope="module")
def model(tiny_path):
    inst = tiny_instance(tiny_path)
    attach_plane(inst.card, inst)
    return inst


@pytest.fixture(scope="module")
def lora_files(model, tmp_path_factory):
    """Two LoRAs in diffusers' format (the second with a saved lora_alpha), one in original Wan's."""
    from diffusers import WanPipeline

    root = tmp_path_factory.mktemp("loras")
    dit = model.component("transformer")
    style = lora_pairs(dit, 1)
    save_file(style, root / "style.safetensors")
    strip = {k.removeprefix("transformer."): v for k, v in lora_pairs(dit, 2).items()}
    WanPipeline.save_lora_weights(
        root / "motion",
        strip,
        transformer_lora_adapter_metadata={"r": 4, "lora_alpha": 8, "target_modules": list(TARGETS)},
    )
    original = {}
    for key, value in lora_pairs(dit, 3).items():  # original Wan's names: self_attn.q, ffn.0, lora_down/up
        key = key.replace("transformer.", "diffusion_model.").replace("attn1.to_q", "self_attn.q")
        key = key.replace("attn1.to_v", "self_attn.v").replace("attn2.to_k", "cross_attn.k")
        key = key.replace("attn2.to_out.0", "cross_attn.o").replace("ffn.net.0.proj", "ffn.0")
        key = key.replace("ffn.net.2", "ffn.2").replace("lora_A", "lora_down").replace("lora_B", "lora_up")
        original[key] = value
    save_file(original, root / "original.safetensors")
    return {
        "style": root / "style.safetensors",
        "motion": root / "motion" / "pytorch_lora_weights.safetensors",
        "original": root / "original.safetensors",
    }


@pytest.fixture(scope="module")
def te_state(model) -> dict:
    """A text-encoder LoRA (diffusers' key layout) on every attention query and value of UMT5."""
    encoder = model.component("text_encoder")
    g = torch.Generator().manual_seed(5)
    names = [
        n for n, m in encoder.named_modules() if isinstance(m, torch.nn.Linear) and n.endswith((".q", ".v"))
    ]
    state = {}
    for n in names:
        linear = encoder.get_submodule(n)
        state[f"text_encoder.{n}.lora_A.weight"] = torch.randn(2, linear.in_features, generator=g) * 0.5
        state[f"text_encoder.{n}.lora_B.weight"] = torch.randn(linear.out_features, 2, generator=g) * 0.5
    return state


@pytest.fixture(scope="module")
def plane(model, lora_files, te_state, tmp_path_factory) -> AdapterPlane:
    for name, path in lora_files.items():
        model.adapters.add(name, path)
    te = tmp_path_factory.mktemp("te") / "te.safetensors"
    save_file(te_state, te)
    model.adapters.add("te", te)
    return model.adapters


class BatchCount:
    """An observer of how many plans each step shared its call with."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def on_step(self, state, plan, result) -> None:
        self.sizes.append(result.batched_with)


def ours(model, adapters=(), seed=11, **params):
    request = front(model).prepare({**BASE, **SMALL, "seed": seed, **params}, adapters=adapters)
    with torch.no_grad():
        return Engine().run_one(WanLoop(model), request, model).outputs["frames"].numpy()


def reference(pipe, loras: dict, scales: list[float], seed=11) -> np.ndarray:
    for name, path in loras.items():
        pipe.load_lora_weights(str(path), adapter_name=name)
    pipe.set_adapters(list(loras), scales)
    try:
        return pipe(
            PROMPT,
            negative_prompt=NEGATIVE,
            num_frames=5,
            height=32,
            width=48,
            num_inference_steps=3,
            guidance_scale=5.0,
            generator=torch.Generator().manual_seed(seed),
            output_type="np",
        ).frames[0]
    finally:
        pipe.unload_lora_weights()


@pytest.mark.parametrize(
    "names,scales",
    [(["style"], [0.8]), (["motion"], [1.0]), (["original"], [0.5]), (["style", "motion"], [0.7, -0.4])],
)
def test_c1_adapters_match_diffusers_set_adapters(model, plane, pipe, lora_files, names, scales):
    ref = reference(pipe, {n: lora_files[n] for n in names}, scales)
    got = ours(model, list(zip(names, scales, strict=True)))
    assert np.abs(got - ref).max() <= 1e-5
    assert np.abs(got - ours(model)).max() > 1e-3, "the adapter changes the video"


def test_the_saved_alpha_scales_the_pairs(lora_files, model):
    contract = model.card.adapters
    pairs = read_lora(lora_files["motion"], contract.loader, contract.components, "transformer")
    assert {p.scale for p in pairs["transformer"].values()} == {2.0}  # lora_alpha 8 / r 4


def test_text_encoder_lora_matches_peft_on_diffusers_text_encoder(model, plane, pipe, te_state):
    """diffusers' Wan loader reads transformer LoRAs only; the reference for a text-encoder LoRA is PEFT
    injected into the pipeline's own text encoder."""
    from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict

    names = sorted(
        {k.removeprefix("text_encoder.").removesuffix(".lora_A.weight") for k in te_state if "lora_A" in k}
    )
    config = LoraConfig(r=2, lora_alpha=2, target_modules=names)
    inject_adapter_in_model(config, pipe.text_encoder, adapter_name="te")
    set_peft_model_state_dict(
        pipe.text_encoder, {k.removeprefix("text_encoder."): v for k, v in te_state.items()}, "te"
    )
    try:
        with torch.no_grad():
            ref_video = pipe(
                PROMPT,
                negative_prompt=NEGATIVE,
                generator=torch.Generator().manual_seed(11),
                output_type="np",
                **SMALL,
            ).frames[0]
    finally:
        from peft.tuners.tuners_utils import BaseTunerLayer

        for module in pipe.text_encoder.modules():  # back to the plain encoder for the other tests
            if isinstance(module, BaseTunerLayer):
                module.delete_adapter("te")
    got = ours(model, ["te"])
    assert np.abs(got - ref_video).max() <= 1e-5
    assert np.abs(got - ours(model)).max() > 1e-3


def test_different_adapters_share_one_batched_step_and_equal_their_solo_runs(model, plane):
    asks = [[("style", 0.8)], [], [("original", 0.5), ("style", 0.3)], [("motion", 1.0)]]
    alone = [ours(model, a, seed=i) for i, a in enumerate(asks)]
    steps = BatchCount()
    engine = Engine(
        observers=[steps], scheduling=SchedulingPolicy("fair")
    )  # fair: every compatible step batched
    items = [
        (
            WanLoop(model),
            front(model).prepare({**BASE, **SMALL, "seed": i}, request_id=f"r{i}", adapters=a),
            model,
        )
        for i, a in enumerate(asks)
    ]
    with torch.no_grad():
        results = engine.run_batched(items)
    for i, (result, solo) in enumerate(zip(results, alone, strict=True)):
        assert (
            np.abs(result.outputs["frames"].numpy() - solo).max()
            <= model.card.parity.tolerances["frames_batched_cfg"]
        ), i
    assert max(steps.sizes) == 4, "all four requests (three adapter sets and none) shared calls"


def test_a_text_encoder_adapter_never_gets_anothers_cached_features(model, plane, tmp_path):
    model.feature_cache.invalidate()
    model.kv_cache.invalidate()
    plain, with_te = ours(model, seed=4), ours(model, ["te"], seed=4)
    again = ours(model, seed=4)  # the cache now holds both: each request must get its own
    assert np.array_equal(plain, again)
    assert np.abs(with_te - plain).max() > 1e-3
    assert np.array_equal(ours(model, ["te"], seed=4), with_te)


def test_readding_an_adapter_bumps_only_its_version(model, plane, lora_files, tmp_path):
    before = {n: e.version for n, e in plane.entries.items()}
    from safetensors.torch import load_file

    save_file({k: v * 2 for k, v in load_file(lora_files["style"]).items()}, tmp_path / "style2.safetensors")
    plane.add("style", tmp_path / "style2.safetensors")
    after = {n: e.version for n, e in plane.entries.items()}
    assert after["style"] != before["style"]
    assert {n: v for n, v in after.items() if n != "style"} == {
        n: v for n, v in before.items() if n != "style"
    }
    plane.add("style", lora_files["style"])
    assert plane.entries["style"].version == before["style"]


def test_bad_adapters_are_refused_clearly(model, plane, tmp_path, lora_files):
    door = front(model)
    with pytest.raises(ConfigError, match=r"adapter 'nope' is not served by this model .*Fix:"):
        door.prepare({**BASE, **SMALL}, adapters=["nope"])
    with pytest.raises(ConfigError, match=r"scale=9 is outside this model's range \[-4.0, 4.0\]"):
        door.prepare({**BASE, **SMALL}, adapters=[("style", 9)])
    with pytest.raises(ConfigError, match="named once"):
        door.prepare({**BASE, **SMALL}, adapters=["style", ("style", 0.5)])
    one = AdapterPlane(model, model.card.adapters, max_per_request=1)
    one.entries = plane.entries
    with pytest.raises(
        ConfigError, match="2 adapters requested; this deployment allows at most 1 per request"
    ):
        one.uses(["style", "motion"])
    (tmp_path / "lora.bin").write_bytes(b"\x80\x04")
    with pytest.raises(ConfigError, match="is a pickle file"):
        plane.add("bad", tmp_path / "lora.bin")
    (tmp_path / "corrupt.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ConfigError, match="not a readable safetensors file"):
        plane.add("bad", tmp_path / "corrupt.safetensors")
    big = lora_pairs(model.component("transformer"), 1)
    wide = {k: torch.randn(4, v.shape[1] + 8) if k.endswith("lora_A.weight") else v for k, v in big.items()}
    save_file(wide, tmp_path / "wide.safetensors")
    with pytest.raises(ConfigError, match=r"does not fit 'wan2.1-t2v-tiny'.*LoRA 40 -> .*the layer 32 ->"):
        plane.add("bad", tmp_path / "wide.safetensors")
    ranks = {k: torch.randn(v.shape[0], 3) if k.endswith("lora_B.weight") else v for k, v in big.items()}
    save_file(ranks, tmp_path / "ranks.safetensors")
    with pytest.raises(ConfigError, match=r"lora_A \(4, 32\) and lora_B .*a LoRA pair needs"):
        plane.add("bad", tmp_path / "ranks.safetensors")
    foreign = {"transformer.transformer_blocks.0.attn1.to_q.lora_A.weight": torch.zeros(4, 32)}
    foreign["transformer.transformer_blocks.0.attn1.to_q.lora_B.weight"] = torch.zeros(32, 4)
    save_file(foreign, tmp_path / "foreign.safetensors")
    with pytest.raises(
        ConfigError, match="transformer.transformer_blocks.0.attn1.to_q: no such linear layer"
    ):
        plane.add("bad", tmp_path / "foreign.safetensors")
    assert "bad" not in plane.entries
    assert np.array_equal(ours(model, [("style", 0.8)]), ours(model, [("style", 0.8)])), "nothing else broke"


def test_the_lru_keeps_what_running_requests_hold(model, lora_files):
    plane = AdapterPlane(model, model.card.adapters, budget_bytes=1)
    with pytest.raises(
        ConfigError, match="over this model's adapter budget of 1. Fix: raise adapter_budget_bytes"
    ):
        plane.add("style", lora_files["style"])
    size = read_size(model, lora_files["style"])
    plane = AdapterPlane(model, model.card.adapters, budget_bytes=int(size * 1.5))
    plane.add("style", lora_files["style"])
    plane.add("original", lora_files["original"])  # evicts style (unheld, least recently used)
    assert plane.loaded_bytes <= plane.budget_bytes
    [use] = plane.uses(["original"])
    plane.hold("r1", [use], {})
    with pytest.raises(ConfigError, match="does not fit the adapter budget .* running requests hold"):
        plane.hold("r2", plane.uses(["style"]), {})
    plane.release("r1")
    plane.release("r2")
    plane.hold("r3", plane.uses(["style"]), {})  # now original may go
    assert plane.loaded_bytes <= plane.budget_bytes


def read_size(model, path: Path) -> int:
    contract = model.card.adapters
    pairs = read_lora(path, contract.loader, contract.components, "transformer")
    return sum(p.nbytes for m in pairs.values() for p in m.values())


def test_peft_folder_and_deploy_entry(model, tmp_path, lora_files):
    from safetensors.torch import load_file

    folder = tmp_path / "peft"
    folder.mkdir()
    tensors = load_file(lora_files["style"])
    save_file(
        {k.replace("transformer.", "base_model.model.", 1): v for k, v in tensors.items()},
        folder / "adapter_model.safetensors",
    )
    (folder / "adapter_config.json").write_text(
        json.dumps({"r": 4, "lora_alpha": 4, "target_modules": list(TARGETS)})
    )
    plane = AdapterPlane(model, model.card.adapters)
    assert plane.add("peft", folder).components == ("transformer",)
    assert read_lora(
        folder, model.card.adapters.loader, model.card.adapters.components, "transformer"
    ).keys() == {"transformer"}


def test_interleave_gate_across_adapters_with_cache_dit(model, plane):
    """Requests with different adapters (and none), FBCache on: interleaved step by step equals serial,
    bit for bit, and the cache decides per request (its residuals are the request's own)."""
    from fv_cache_dit import FBCache
    from fv_core.parity import assert_interleave_parity

    asks = [[("style", 0.8)], [], [("motion", 1.0), ("te", 0.5)]]

    def items():
        return [
            (
                WanLoop(model),
                front(model).prepare(
                    {**BASE, **SMALL, "num_inference_steps": 6, "seed": i}, request_id=f"g{i}", adapters=a
                ),
                model,
            )
            for i, a in enumerate(asks)
        ]

    def engine():
        return Engine(interceptors=[FBCache(residual_diff_threshold=0.3, max_warmup_steps=2)])

    with torch.no_grad():
        assert_interleave_parity(engine, items)


def test_a14b_adapter_into_both_experts_or_one(variant_folders, wan_host, tmp_path):
    """Wan2.2 A14B, each expert separately: a transformer LoRA into the second (low-noise) expert alone
    equals diffusers' ``load_lora_weights(..., load_into_transformer_2=True)``; into both, diffusers
    loading it into each."""
    from diffusers import WanPipeline

    import fv_core

    folder = variant_folders["t2v-a14b", "second"]
    model = fv_core.load(weights=folder, host=wan_host)
    path = tmp_path / "both.safetensors"
    save_file(lora_pairs(model.instance.component("transformer"), 7), path)
    model.instance.adapters.add("both", path, into={"transformer": ["transformer", "transformer_2"]})
    model.instance.adapters.add("low", path, into={"transformer": ["transformer_2"]})
    settings = dict(
        prompt=PROMPT, negative_prompt=NEGATIVE, num_frames=5, height=32, width=48, num_inference_steps=6
    )
    settings["guidance_scale"] = 3.0
    settings["guidance_scale_2"] = 2.0
    with torch.no_grad():
        both = model.generate(**settings, max_sequence_length=512, seed=5, adapters=["both"]).frames
        low = model.generate(**settings, max_sequence_length=512, seed=5, adapters=["low"]).frames
        pipe = WanPipeline.from_pretrained(folder)
        pipe.set_progress_bar_config(disable=True)

        def reference():
            return pipe(**settings, generator=torch.Generator().manual_seed(5), output_type="np").frames[0]

        pipe.load_lora_weights(str(path), adapter_name="lora", load_into_transformer_2=True)
        ref_low = reference()
        pipe.load_lora_weights(str(path), adapter_name="lora")
        ref_both = reference()
    assert np.abs(low - ref_low).max() <= 1e-5
    assert np.abs(both - ref_both).max() <= 1e-5
    assert np.abs(both - low).max() > 1e-3
    assert model.instance.adapters.entries["both"].components == ("transformer", "transformer_2")
