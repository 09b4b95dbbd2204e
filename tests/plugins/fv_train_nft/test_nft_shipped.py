"""The shipped ``wan2.1-t2v-shapes-nft`` card: the NFT student's transformer next to its parent,
sharing the parent's VAE, text encoder, tokenizer and scheduler files, with its recipe."""

from __future__ import annotations

import json
from pathlib import Path

import torch

import fv_core
from fv_core.loop import WorkUnitKind
from fv_core.training import check_c2, rollout


def test_nft_card_ships_only_its_transformer_and_shares_the_parents_files():
    model = fv_core.load("wan2.1-t2v-shapes-nft")
    parent = fv_core.load("wan2.1-t2v-shapes")
    folder = Path(model.weights)
    assert sorted(p.name for p in folder.iterdir()) == ["fv_recipe.json", "model_index.json", "transformer"]
    recipe = json.loads((folder / "fv_recipe.json").read_text())
    assert recipe["method"] == "nft" and recipe["parents"] == ["wan2.1-t2v-shapes"]
    assert model.card.recipe.method == "diffusion_nft" and model.card.recipe.parents == ["wan2.1-t2v-shapes"]
    for name in ("vae", "text_encoder"):  # the parent's weights, loaded from the parent's files
        ours, theirs = (
            model.instance.component(name).state_dict(),
            parent.instance.component(name).state_dict(),
        )
        assert all(torch.equal(ours[k], theirs[k]) for k in theirs), name
    mine = model.instance.component("transformer").state_dict()
    base = parent.instance.component("transformer").state_dict()
    assert any(not torch.equal(mine[k], base[k]) for k in base)  # NFT changed it
    video = model.generate(prompt="a red square moving left", num_inference_steps=4, seed=1)
    assert video.frames.shape == (9, 64, 64, 3)


def test_c2_on_recorded_rollout_steps_of_the_shipped_card():
    """The C2 gate on BehaviorRecords: a rollout of the NFT card through the engine (as the method's
    old policy rolls out), each recorded denoise step replayed on the live weights under the train
    profile equals the serve profile bit for bit on the velocity NFT trains on."""
    model = fv_core.load("wan2.1-t2v-shapes-nft")
    [ro] = rollout(model, [dict(prompt="a green square moving up", seed=4, num_inference_steps=3)])
    denoise = [i for i, s in enumerate(ro.record.steps) if s.kind == WorkUnitKind.DIFFUSION_STEP.value]
    assert len(denoise) == 3
    for i in denoise:
        trained = check_c2(model, ro.record, i, ["velocity"])["velocity"]
        assert trained.requires_grad and torch.equal(trained.detach(), ro.record.steps[i].outputs["velocity"])
