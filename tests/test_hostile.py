"""bench.hostile: issue 40's attacks against a real `meta serve`, at --quick sizes, with a
soak; its JSON carries every key and target, and its targets hold."""

from __future__ import annotations

import json
import subprocess
import sys

from bench.hostile import p99
from tests.fixtures.service import ROOT

KEYS = {
    "rss_growth_mib", "legit_p99_vs_quiet", "legit_refused", "service_cpu_waiters",
    "soak_rss_growth_mib", "targets", "pass", "phases", "memory_budget_mib",
}  # fmt: skip
PHASES = {"nonreaders", "stalled", "waiters", "long_waits", "scrapers", "all"}


def test_bench_hostile_quick_reports_every_target_and_passes():
    p = subprocess.run(
        [sys.executable, "-m", "bench.hostile", "--quick"],
        capture_output=True, text=True, timeout=400, cwd=ROOT,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    rep = json.loads(p.stdout)
    assert KEYS <= set(rep), KEYS - set(rep)
    assert set(rep["phases"]) == PHASES
    assert set(rep["targets"]) >= {"rss_growth_mib", "legit_p99_vs_quiet", "legit_refused",
                                   "service_cpu_waiters", "soak_rss_growth_mib"}  # fmt: skip
    assert rep["phases"]["stalled"]["stalled_dropped_s"] is not None  # dropped, not held
    assert rep["legit_refused"] == 0, rep["legit_errors"]
    assert rep["pass"] is True, {k: v for k, v in rep["targets"].items() if not v["ok"]}


def test_p99_takes_the_99th_percentile():
    assert p99([float(i) for i in range(1, 101)]) == 100.0
    assert p99([3.0, 1.0, 2.0]) == 3.0
