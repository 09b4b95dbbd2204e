"""A LoRA trained by the flow method on the adapter plane's hooks: only the pairs move, the export is
diffusers' format, and the file served per request equals the merged model it came from and diffusers'
``load_lora_weights`` on the same file."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from train_flow_support import flow_config

from fv_core import ConfigError, load
from fv_core.adapters import adapter_rows, read_lora
from fv_core.training import Role, train, validate
from fv_train_flow import shapes
from fv_train_flow.method import LORA, FlowMethod

RANK, ALPHA = 4, 16.0
REQUEST = dict(
    prompt="a red circle moving left", num_frames=5, height=32, width=32, num_inference_steps=2,
    guidance_scale=4.0, max_sequence_length=16, seed=3,
)  # fmt: skip


def lora_config(out, vae_dir, steps: int = 8, **options) -> dict:
    cfg = flow_config(out, vae_dir, steps=steps)
    cfg["optim"]["lr"] = 1e-2
    cfg["options"] |= {"lora_rank": RANK, "lora_alpha": ALPHA, "max_sequence_length": 16, **options}
    return cfg


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, vae_dir):
    """A tiny fresh model, then 8 LoRA steps: the method, its state before training, the run folder."""
    out = tmp_path_factory.mktemp("flow-lora")
    method = FlowMethod(validate(lora_config(out, vae_dir)))
    before = {
        "val_loss": method.evaluate(0)["val_loss"],
        "base": {k: v.clone() for k, v in base_state(method).items()},
        "pairs": [p.detach().clone() for p in method.roles[Role.STUDENT][LORA].parameters()],
    }
    train(method.cfg, method, progress=False)
    return method, before, out


def base_state(method: FlowMethod) -> dict[str, torch.Tensor]:
    """Every base weight of the model being served (its live transformer and text encoder)."""
    return {
        f"{name}.{key}": value
        for name in ("transformer", "text_encoder")
        for key, value in method.adapter.module(name).state_dict().items()
    }


def test_only_the_pairs_train_and_the_loss_goes_down(lora_run):
    method, before, _ = lora_run
    trainable = method.trainable()
    assert trainable and all(
        any(p is q for q in method.roles[Role.STUDENT][LORA].parameters()) for p in trainable
    )
    after = base_state(method)
    assert after.keys() == before["base"].keys()
    assert all(torch.equal(after[k], before["base"][k]) for k in after), "the base is bit-identical"
    pairs = list(method.roles[Role.STUDENT][LORA].parameters())
    moved = [float((a - b).abs().max()) for a, b in zip(pairs, before["pairs"], strict=True)]
    assert min(moved) > 0, "every pair moved"
    assert method.evaluate(8)["val_loss"] < before["val_loss"]


def test_the_export_is_diffusers_lora_format(lora_run):
    method, _, out = lora_run
    file = out / "final" / "pytorch_lora_weights.safetensors"
    with safe_open(str(file), "pt") as handle:
        keys, meta = set(handle.keys()), json.loads(handle.metadata()["lora_adapter_metadata"])
    ema = method.roles[Role.EMA][LORA]
    assert keys == {f"transformer.{p}.lora_{ab}.weight" for p in ema.paths for ab in "AB"}
    assert any(".attn1.to_q." in k for k in keys) and any(".ffn.net.2." in k for k in keys)
    assert meta["transformer.r"] == RANK and meta["transformer.lora_alpha"] == ALPHA
    assert sorted(meta["transformer.target_modules"]) == sorted(ema.paths)
    contract = method.adapter.model.card.adapters
    pairs = read_lora(file, contract.loader, contract.components, "transformer")["transformer"]
    assert {p.scale for p in pairs.values()} == {ALPHA / RANK}
    for path, down, up in zip(ema.paths, ema.down, ema.up, strict=True):
        assert torch.equal(pairs[path].down, down) and torch.equal(pairs[path].up, up)
    recipe = json.loads((out / "final" / "fv_recipe.json").read_text())
    assert recipe["lora"]["rank"] == RANK and recipe["base"] == str(out / "init")


def merged_frames(out) -> torch.Tensor:
    """The base with every pair merged into a copy of its weights: W + alpha / r * B @ A."""
    model = load(weights=out / "init")
    transformer = model.instance.component("transformer")
    contract = model.card.adapters
    pairs = read_lora(out / "final", contract.loader, contract.components, "transformer")["transformer"]
    with torch.no_grad():
        for path, pair in pairs.items():
            transformer.get_submodule(path).weight += pair.scale * pair.up @ pair.down
    return torch.as_tensor(model.generate(**REQUEST).frames)


def test_the_file_served_per_request_equals_the_merged_model(lora_run):
    _, _, out = lora_run
    model = load(weights=out / "init")
    model.instance.adapters.add("trained", out / "final")
    served = torch.as_tensor(model.generate(**REQUEST, adapters=["trained"]).frames)
    base = torch.as_tensor(model.generate(**REQUEST).frames)
    merged = merged_frames(out)
    assert (served - merged).abs().max() <= 1e-5
    assert (served - base).abs().max() > 1e-3, "the trained adapter changes the video"


def test_the_file_served_per_request_equals_diffusers_load_lora_weights(lora_run):
    from diffusers import WanPipeline

    _, _, out = lora_run
    model = load(weights=out / "init")
    model.instance.adapters.add("trained", out / "final")
    served = model.generate(**REQUEST, adapters=["trained"]).frames
    pipe = WanPipeline.from_pretrained(out / "init")
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(out / "final"), adapter_name="trained")
    params = {k: v for k, v in REQUEST.items() if k != "seed"}
    with torch.no_grad():
        ref = pipe(**params, negative_prompt=model.prepare({"prompt": "-"}).params.negative_prompt,
                   generator=torch.Generator().manual_seed(REQUEST["seed"]), output_type="np").frames[0]  # fmt: skip
    assert abs(torch.as_tensor(served) - torch.as_tensor(ref)).max() <= 1e-5


def test_a_checkpoint_resumes_the_pairs_exactly(lora_run, vae_dir, tmp_path):
    method, _, out = lora_run
    resumed = FlowMethod(validate(lora_config(tmp_path, vae_dir)))
    resumed.load(out / "checkpoint-8")
    for role in (Role.STUDENT, Role.EMA):
        for a, b in zip(
            method.roles[role][LORA].parameters(), resumed.roles[role][LORA].parameters(), strict=True
        ):
            assert torch.equal(a, b)


def test_lora_refuses_a_trained_text_encoder_and_unknown_targets(vae_dir, tmp_path):
    with pytest.raises(ConfigError, match="train_text_encoder=true with lora_rank=4"):
        FlowMethod(validate(lora_config(tmp_path / "a", vae_dir, train_text_encoder=True)))
    with pytest.raises(ConfigError, match=r"recolour=\{'pink'.*unknown: \['pink'\]"):
        FlowMethod(validate(lora_config(tmp_path / "c", vae_dir, recolour={"pink": [1, 0, 0]})))
    with pytest.raises(ConfigError, match=r"lora_targets=\['to_qq'\] match no linear layer"):
        FlowMethod(validate(lora_config(tmp_path / "b", vae_dir, lora_targets=["to_qq"])))


def test_the_training_forward_is_the_served_forward_bit_for_bit(lora_run, tmp_path):
    """The student's velocity under the train profile equals, bit for bit, the serve profile's with the
    student's exported file registered as a served adapter and named by the row."""
    method, _, _ = lora_run
    student, plane = method.roles[Role.STUDENT][LORA], method.adapter.model.instance.adapters
    student.save(tmp_path, method.adapter.model.card.adapters.loader)
    plane.add("exported-student", tmp_path)
    uses = plane.uses(["exported-student"])
    plane.hold("test", uses, {})
    x0 = method.latents(shapes.batch(5, 0, 2)[0])
    sigma = torch.tensor([0.3, 0.7])
    x = (1 - sigma.view(-1, 1, 1, 1, 1)) * x0 + sigma.view(-1, 1, 1, 1, 1) * torch.randn_like(x0)
    embeds = method.adapter.conditioning(["a red circle moving left", "a blue square moving up"])
    transformer = method.adapter.module("transformer")
    with student.applied():
        trained = method.adapter.velocity(transformer, x, sigma, embeds, train=True)
    try:
        with adapter_rows((uses, uses)):
            served = method.adapter.velocity(transformer, x, sigma, embeds, train=False)
    finally:
        plane.release("test")
        plane.remove("exported-student")
    assert trained.requires_grad and not served.requires_grad
    assert torch.equal(trained.detach(), served)


def test_recolour_draws_a_colour_in_other_rgb_under_the_same_caption():
    spec = shapes.ClipSpec("red", "square", "left", (40.0, 32.0))
    plain, green = shapes.render(spec), shapes.render(spec, {"red": (0.1, 0.8, 0.2)})
    centre = (0, 32, 40)
    assert torch.allclose(plain[centre], torch.tensor(shapes.COLOURS["red"]))
    assert torch.allclose(green[centre], torch.tensor([0.1, 0.8, 0.2]))
    assert torch.equal(plain[0, 0, 0], green[0, 0, 0])  # the background is unchanged
