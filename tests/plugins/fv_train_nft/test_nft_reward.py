"""The ``shapes-detector`` reward (fv-train-flow), reached by name as NFT reaches it: ground-truth
shapes clips score near 1 against their own captions and low against wrong ones."""

from __future__ import annotations

import pytest
import torch

from fv_core import ConfigError
from fv_core.training import load_reward
from fv_train_flow import shapes


@pytest.fixture(scope="module")
def clips():
    video, specs = shapes.batch(3, 0, 12, shapes.ALL_COMBOS)
    return (video.permute(0, 2, 3, 4, 1) + 1) / 2, specs  # [B, F, H, W, 3] in 0..1


def swap(spec, attribute: str) -> str:
    colour, shape, direction = spec.colour, spec.shape, spec.direction
    if attribute == "colour":
        colour = next(c for c in shapes.COLOURS if c != colour)
    elif attribute == "shape":
        shape = "circle" if shape == "square" else "square"
    else:
        direction = {"left": "right", "right": "left", "up": "down", "down": "up"}[direction]
    return shapes.caption(colour, shape, direction)


def test_ground_truth_clips_score_high_and_wrong_prompts_low(clips):
    frames, specs = clips
    reward = load_reward("shapes-detector")
    right = reward(frames, [s.caption for s in specs])
    assert right.shape == (12,) and bool((right > 0.95).all()), right
    for attribute in ("colour", "shape", "direction"):
        wrong = reward(frames, [swap(s, attribute) for s in specs])
        assert bool((wrong < 0.72).all()), (attribute, wrong)  # one attribute of three lost
        exact = load_reward("shapes-detector", weights={attribute: 1.0}, soft=False)
        assert torch.equal(exact(frames, [s.caption for s in specs]), torch.ones(12))
        assert torch.equal(exact(frames, [swap(s, attribute) for s in specs]), torch.zeros(12))
    blank = torch.full_like(frames, 0.12)  # nothing drawn: nothing rewarded
    assert torch.equal(reward(blank, [s.caption for s in specs]), torch.zeros(12))


def test_soft_shape_score_follows_the_fill_margin(clips):
    frames, specs = clips
    square = next(i for i, s in enumerate(specs) if s.shape == "square")
    soft = load_reward("shapes-detector", weights={"shape": 1.0})
    sharp = soft(frames[square : square + 1], [specs[square].caption])
    rounded = frames[square : square + 1].clone()
    # shave the corners: a square whose fill drops toward the threshold scores lower, not 0
    ys, xs = torch.meshgrid(torch.arange(64), torch.arange(64), indexing="ij")
    for f in range(shapes.FRAMES):
        obj = (frames[square, f] - 0.12).abs().amax(-1) > 0.2
        y, x = obj.nonzero(as_tuple=True)
        cy, cx = y.float().mean(), x.float().mean()
        corner = ((ys - cy).abs() + (xs - cx).abs()) > 18
        rounded[0, f][obj & corner] = torch.tensor(shapes.BACKGROUND)
    shaved = soft(rounded, [specs[square].caption])
    assert 0.0 < shaved.item() < sharp.item()


def test_bad_prompts_and_options_are_config_errors(clips):
    frames, _ = clips
    with pytest.raises(ConfigError, match="not a shapes caption"):
        load_reward("shapes-detector")(frames[:1], ["a cat"])
    with pytest.raises(ConfigError, match="weights"):
        load_reward("shapes-detector", weights={"shape": 0.0})
    with pytest.raises(ConfigError, match="temperature"):
        load_reward("shapes-detector", temperature=0)
