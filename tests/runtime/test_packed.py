"""The packed form of WorkPlan (requests of different token counts as one sequence) and the
packed_attention kernels: each segment attends to itself only, equal to its attention alone."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from fv_core import kernels_packed
from fv_core.errors import UnknownKeyError
from fv_core.kernels_select import select_kernel
from fv_core.loop import SEGMENTS, Profile, WorkPlan, WorkUnitKind
from fv_core.plugins import PluginHost
from fv_core.runtime.batching import run_batch

LENGTHS = (5, 17, 1, 9)


def body(seen: list, inputs: dict) -> dict:
    """Doubles each token plus its request's offset; reports what the call saw."""
    seen.append({k: v for k, v in inputs.items() if k != "x"})
    offsets = torch.repeat_interleave(inputs["offset"], torch.tensor(inputs[SEGMENTS]["x"]))
    return {"y": inputs["x"] * 2 + offsets[None, :, None], "next": inputs["offset"] + 1}


def plan(seen: list, n: int, offset: float, tag: str) -> WorkPlan:
    return WorkPlan(
        kind=WorkUnitKind.DIFFUSION_STEP,
        body=partial(body, seen),
        inputs={"x": torch.full((1, n, 3), float(n)), "offset": torch.tensor([offset]), "tag": tag},
        packed={"x": 1, "tag": 0},
        packed_outputs={"y": "x"},
        label=f"plan {n}",
    )


def test_plans_of_different_lengths_run_as_one_sequence_and_split_back():
    seen: list = []
    plans = [plan(seen, n, float(i), f"r{i}") for i, n in enumerate(LENGTHS)]
    results = run_batch(plans, Profile.SERVE)
    assert seen[0][SEGMENTS] == {"x": LENGTHS} and seen[0]["tag"] == ("r0", "r1", "r2", "r3")
    for i, (n, res) in enumerate(zip(LENGTHS, results, strict=True)):
        assert res.batched_with == 4 and res.outputs["y"].shape == (1, n, 3)
        assert torch.equal(res.outputs["y"], torch.full((1, n, 3), 2.0 * n + i))
    # a non-packed output is split by rows (one per plan)
    assert [r.outputs["next"].tolist() for r in results] == [[1.0], [2.0], [3.0], [4.0]]


def test_a_plan_of_several_rows_is_refused_in_a_packed_call():
    seen: list = []
    wide = plan(seen, 4, 0.0, "a")
    wide.batch_size, wide.inputs["x"], wide.inputs["offset"] = 2, torch.ones(2, 4, 3), torch.zeros(2)
    with pytest.raises(ValueError, match=r"joins a packed call with batch_size=2 .* Fix: give every plan"):
        run_batch(
            [plan(seen, 3, 0.0, "b"), wide],
            Profile.SERVE,
        )


def qkv(lengths, heads=2, dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(1, heads, sum(lengths), dim, generator=gen) for _ in range(3)]


def alone(q, k, v, lengths):
    bounds = kernels_packed.cu_seqlens(lengths).tolist()
    return [
        torch.nn.functional.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b])
        for a, b in zip(bounds[:-1], bounds[1:], strict=True)
    ]


def flex_uncompiled(query, key, value, cu_seqlens):
    """packed_flex's document mask under flex attention's eager path (its compile takes a minute here;
    bench/qwen_image.py measures the compiled kernel)."""
    from torch.nn.attention.flex_attention import flex_attention

    mask = kernels_packed.document_mask(cu_seqlens, query.shape[2], query.device, compile=False)
    return flex_attention(query, key, value, block_mask=mask)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("variant", ["segments", "sdpa", "flex"])
def test_each_segment_attends_to_itself_only(variant):
    q, k, v = qkv(LENGTHS)
    kernel = flex_uncompiled if variant == "flex" else getattr(kernels_packed, f"packed_{variant}")
    out = kernel(q, k, v, kernels_packed.cu_seqlens(LENGTHS))
    refs = alone(q, k, v, LENGTHS)
    for part, ref in zip(out.split(list(LENGTHS), 2), refs, strict=True):
        if variant == "segments":
            assert torch.equal(part, ref)  # the same call on the same shapes as alone
        else:
            assert (part - ref).abs().max() < 1e-5
    # changing one request's keys leaves the others' outputs alone
    k2 = k.clone()
    k2[:, :, 5:22] += 1.0
    moved = kernel(q, k2, v, kernels_packed.cu_seqlens(LENGTHS))
    assert torch.equal(moved[:, :, :5], out[:, :, :5]) and not torch.equal(moved[:, :, 5:22], out[:, :, 5:22])


def test_packed_kernels_are_selected_through_the_registry():
    host = PluginHost(env={})
    host.collect()
    registries = host.registries
    impl, record = select_kernel(registries, "packed_attention", "segments", "cpu")
    assert impl is kernels_packed.packed_segments and record["key"] == [
        "packed_attention",
        "any",
        "any",
        "segments",
    ]
    if (
        not kernels_packed.flash_attn_installed()
    ):  # flash-attn's varlen kernel is registered only where it imports
        with pytest.raises(UnknownKeyError, match="varlen"):
            select_kernel(registries, "packed_attention", "varlen", "cpu")
