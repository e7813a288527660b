"""bench.guard's verdict: the median of the runs against the bound file's bounds."""

from __future__ import annotations

import json

from bench.guard import BOUNDS, judge

BOUNDS_DOC = {"figures": {"ratio": {"max": 10.0}, "speedup": {"min": 2.0}}}


def test_a_median_past_its_bound_fails_and_one_bad_run_does_not():
    report, failed = judge({"ratio": [9.0, 40.0, 9.5], "speedup": [1.0, 2.5, 3.0]}, BOUNDS_DOC)
    assert failed == [] and report["ratio"]["median"] == 9.5 and report["speedup"]["ok"]
    report, failed = judge({"ratio": [30.0, 29.0, 9.0], "speedup": [1.9, 1.0, 3.0]}, BOUNDS_DOC)
    assert [line.split(":")[0] for line in failed] == ["ratio", "speedup"]
    assert not report["ratio"]["ok"] and report["ratio"]["bound"] == "<= 10.0"


def test_the_repository_bounds_name_what_they_came_from():
    with open(BOUNDS) as f:
        doc = json.load(f)
    for name in ("publish_vs_baseline", "manifest_vs_baseline", "step2_speedup"):
        spec = doc["figures"][name]
        assert ("max" in spec) != ("min" in spec), name
        assert spec["measured"] and spec["on"], name
        bound = spec.get("max", spec.get("min"))
        # loose enough for noise, tight enough for a fourfold regression
        ratio = bound / spec["median"] if "max" in spec else spec["median"] / bound
        assert 1.2 <= ratio <= 2.0, (name, ratio)
