"""The shapes dataset is deterministic and the detector reads ground-truth clips correctly."""

import torch

from fv_train_flow import shapes
from fv_train_flow.detect import detect


def test_clips_are_deterministic_by_seed_and_index():
    a, specs_a = shapes.batch(3, 10, 4)
    b, specs_b = shapes.batch(3, 10, 4)
    c, _ = shapes.batch(4, 10, 4)
    assert torch.equal(a, b) and specs_a == specs_b
    assert not torch.equal(a, c)
    assert a.shape == (4, 3, shapes.FRAMES, shapes.SIZE, shapes.SIZE) and a.min() >= -1 and a.max() <= 1


def test_training_stream_excludes_held_out_combinations():
    _, specs = shapes.batch(0, 0, 200)
    seen = {(s.colour, s.shape, s.direction) for s in specs}
    assert not seen & shapes.HELD_OUT
    for colour, shape, direction in shapes.HELD_OUT:  # every word still appears in training captions
        assert any(c == colour for c, _, _ in seen) and any(d == direction for _, _, d in seen)
        assert any(s == shape for _, s, _ in seen)


def test_detector_is_correct_on_ground_truth_clips():
    video, specs = shapes.batch(7, 0, 4 * len(shapes.ALL_COMBOS), shapes.ALL_COMBOS)
    frames = (video.permute(0, 2, 3, 4, 1) + 1) / 2
    for clip, spec in zip(frames, specs, strict=True):
        found = detect(clip)
        assert found.matches(spec) == {"colour": True, "shape": True, "direction": True}, spec
        assert abs(found.start[0] - spec.start[0]) < 1 and abs(found.start[1] - spec.start[1]) < 1
        ideal = 1.0 if spec.shape == "square" else torch.pi / 4  # fill of the bounding box
        assert abs(found.fill - ideal) < 0.05, (spec, found.fill)


def test_detector_reports_nothing_on_an_empty_clip():
    empty = torch.tensor(shapes.BACKGROUND).expand(shapes.FRAMES, shapes.SIZE, shapes.SIZE, 3)
    assert detect(empty).colour is None and detect(empty).direction is None


def test_eval_scores_each_caption_on_its_own():
    from fv_train_flow.detect import Detection
    from fv_train_flow.eval import score

    held = sorted(shapes.HELD_OUT)[0]
    seen = shapes.TRAIN_COMBOS[0]
    specs = [shapes.ClipSpec(*held, (20.0, 32.0)), shapes.ClipSpec(*held, (44.0, 32.0))]
    specs.append(shapes.ClipSpec(*seen, (32.0, 32.0)))
    found = [detect(shapes.render(s)) for s in specs]
    wrong = "circle" if held[1] == "square" else "square"  # the second held-out clip misread
    found[1] = Detection(found[1].colour, wrong, found[1].direction, found[1].start, 0.5)
    rows = score([(s, 0) for s in specs], found)["by_caption"]
    first, other = rows[specs[0].caption], rows[specs[2].caption]
    assert first["n"] == 2 and first["held_out"] and not other["held_out"]
    assert first["shape"] == 0.5 and first["colour"] == 1.0 and other["shape"] == 1.0
    assert abs(first["start_distance"] - 12.0) < 1.0 and other["start_distance"] < 1.0
