"""bench/trace_falsifier.py's smoke mode runs end to end: one seeded trace under every policy."""

import pytest

from bench.trace_falsifier import Arrival, make_trace, overlap, pct, smoke

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_the_trace_is_seeded_and_mixed():
    a, b = make_trace(12, 3, [(5, 32, 32), (9, 48, 48)], [1, 2, 4]), make_trace(12, 3, [(5, 32, 32)], [1])
    assert a == make_trace(12, 3, [(5, 32, 32), (9, 48, 48)], [1, 2, 4]) and a != b
    assert [x.at_s for x in a] == sorted(x.at_s for x in a) and a[0].at_s == 0.0
    assert {x.size for x in a} == {32, 48} and {x.steps for x in a} == {1, 2, 4}
    assert isinstance(a[0], Arrival)


def test_quantiles_and_overlap():
    assert pct([3.0, 1.0, 2.0], 0.5) == 2.0 and pct([1.0, 2.0], 0.95) == pytest.approx(1.95)
    assert overlap([(0, 1), (1, 2), (2, 3)]) == 1  # back to back: one at a time
    assert overlap([(0, 2), (1, 3), (1.5, 4)]) == 3


def test_smoke_serves_the_same_trace_under_every_policy(tmp_path):
    result = smoke(tmp_path, requests=4)
    at_load = result["loads"]["1"]
    pols = at_load["policies"]
    assert set(pols) == {"fifo", "fair", "auto"} and all(p["requests"] == 4 for p in pols.values())
    assert pols["fifo"]["running_overlap_max"] == 1  # request-level FIFO: never two requests mid-run
    assert 1 <= pols["fair"]["running_overlap_max"] <= 4
    for p in pols.values():
        assert 0 < p["ttfs_p50_s"] <= p["latency_p50_s"] <= p["latency_p95_s"]
        assert p["ttfs_p95_s"] <= p["latency_p95_s"] and p["throughput_rps"] > 0
        assert len(p["per_round"][0]["latencies_s"]) == 4
    assert pols["fifo"]["decisions"]["batch"] == 0 and pols["fifo"]["decisions"]["alone"] > 0
    assert set(at_load["auto_vs_best"]) >= {"latency_p50_s", "latency_p95_s", "throughput_rps"}
    assert max(at_load["outputs_max_abs_diff_vs_fifo"].values()) < 1e-3  # the same videos under every policy
