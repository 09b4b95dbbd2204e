"""Folded text keys/values: a request holds its prompt's positions, not the 512 padded ones. A call of
one row unfolds them one block at a time, bit for bit; a call of several rows (zero-padded to the
longest fold) attends to the folds with the repeated position's multiplicity, equal within rounding."""

from __future__ import annotations

import pytest
import torch
from wan_support import request, tiny_instance

from fv_core.cache import RepeatedTail
from fv_core.extend import BLOCKS_INPUT
from fv_core.loop import Profile
from fv_core.loop.runner import run_plan
from fv_core.runtime import Engine
from fv_core.runtime.batching import padded
from fv_wan.bodies import denoise_body
from fv_wan.t2v_loop import WanLoop
from fv_wan.transformer import folded_text_kv, text_kv


def _embeds(model, *prompts: str) -> torch.Tensor:
    """The prompts' text embeddings, through a request each without CFG (its feature cache entries)."""
    with torch.no_grad():
        for i, prompt in enumerate(prompts):
            Engine().run_one(
                WanLoop(model),
                request(model, f"e{i}", prompt=prompt, num_inference_steps=1, guidance_scale=1.0),
                model,
            )
    return torch.stack([model.feature_cache.get(k) for k in model.feature_cache.keys()])


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def test_folded_text_kv_unfolds_to_text_kv_bit_for_bit(tiny_path):
    model = tiny_instance(tiny_path)
    text = _embeds(model, "a cat", "a red car driving in the city at night")
    transformer = model.component("transformer")
    with torch.no_grad():
        full = text_kv(transformer, text)
        kv, rows = folded_text_kv(transformer, text)
    assert kv.shape[-2] < full.shape[-2] / 20 and int(rows.min()) < int(rows.max()) == kv.shape[-2]
    for row in range(text.shape[0]):
        head = kv[row].narrow(-2, 0, int(rows[row]))
        assert torch.equal(_bits(RepeatedTail(head, full.shape[-2], -2).expand()), _bits(full[row]))


FOLDED_ATOL = 1e-5  # the folded attention against the unfolded one: float rounding only


@pytest.mark.parametrize("length", [None, "longest"], ids=["padded", "a_row_holds_every_position"])
def test_denoise_body_on_folds_matches_full_keys_values(tiny_path, length):
    """``length="longest"``: the text is cut to the longest prompt's fold, so that row holds every
    position (its repeated one counts once)."""
    model = tiny_instance(tiny_path)
    text = _embeds(model, "a cat", "a red car driving in the city at night", "a dog")
    transformer = model.component("transformer")
    latents = torch.randn(3, 16, 2, 4, 6, generator=torch.Generator().manual_seed(0))
    step = {"latents": latents, "timestep": torch.full((3,), 700.0), BLOCKS_INPUT: None}
    with torch.no_grad():
        if length == "longest":
            text = text[:, : int(folded_text_kv(transformer, text)[1].max())]
        folds = [folded_text_kv(transformer, text[i : i + 1]) for i in range(3)]
        # each request's own keys/values unfolded (one row's projections can differ from a batch's in the
        # last bits; the first test pins folding to text_kv row by row)
        unfolded = [RepeatedTail(kv.narrow(-2, 0, int(n)), text.shape[1], -2).expand() for kv, n in folds]
        full = denoise_body(transformer, {**step, "kv": torch.cat(unfolded)})["velocity"]
        kv = torch.cat(padded([f[0] for f in folds], 3))  # what the runtime's ragged concatenation makes
        rows = torch.cat([f[1] for f in folds])
        inputs = {**step, "kv": kv, "kv_rows": rows, "kv_length": text.shape[1]}
        batched = denoise_body(transformer, inputs)["velocity"]
        wider = torch.cat([kv, torch.zeros_like(kv[..., :5, :])], 3)  # as a batch with a longer fold pads
        widened = denoise_body(transformer, {**inputs, "kv": wider})["velocity"]
        # the padding counted only up to the longest fold instead of up to all 512 positions
        undercounted = denoise_body(transformer, {**inputs, "kv_length": int(rows.max())})["velocity"]
        alone = [
            denoise_body(
                transformer,
                {**step, "latents": latents[i : i + 1], "timestep": step["timestep"][:1], "kv": kv_i}
                | {"kv_rows": rows_i, "kv_length": text.shape[1]},
            )["velocity"]
            for i, (kv_i, rows_i) in enumerate(folds)
        ]
    assert folds[0][0].shape[-2] != folds[1][0].shape[-2]
    assert (batched - full).abs().max() <= FOLDED_ATOL
    assert torch.equal(_bits(widened), _bits(batched))  # how far rows are padded never shows
    if length is None:  # 512 positions: the multiplicity is what makes it equal
        assert (undercounted - full).abs().max() > 100 * FOLDED_ATOL
    for i, one in enumerate(alone):  # a row alone unfolds: bit for bit its full keys/values
        solo = denoise_body(
            transformer,
            {**step, "latents": latents[i : i + 1], "timestep": step["timestep"][:1], "kv": unfolded[i]},
        )
        assert torch.equal(_bits(one), _bits(solo["velocity"])), i


def test_a_request_holds_its_prompt_positions_only(tiny_path):
    model = tiny_instance(tiny_path)
    loop = WanLoop(model)
    for attempt in ("computed", "cached"):
        state = loop.init(request(model, attempt), model)
        while state.values["phase"] != "denoise":
            loop.advance(state, run_plan(loop.next(state), Profile.SERVE))
        kv = state.tensors["kv.transformer"]
        assert kv.shape[-2] == int(state.tensors["kv_rows.transformer"].max()) < 512 / 20, attempt
    assert state.values["kv_cache_hits"] == 2
