"""The benchmark guard: the figures ckptfs exists for, held to bounds kept in the repository.

`make test` (and so CI) runs it after the suite. Each figure is a ratio of two things
measured in the same run, so it does not depend on how fast the machine is:

  publish_vs_baseline   bench.commit, 4,096 ranks on SQLite: the publish over one round
                        trip of 4,096 pipelined pings (lower is better)
  manifest_vs_baseline  the same run: 4,096 ranks asking for their manifest at once, over
                        the same round trip (lower is better)
  step2_speedup         bench.dcp, 4 gloo ranks, 64 MiB: step 1's save over step 2's, where
                        90% of the tensors are unchanged (higher is better)

Each is the median of three runs (bench.dcp: three rounds of one run, each round a fresh
volume; its one-time costs fall in the first). A figure worse than its bound in
bench/guard_bounds.json fails the guard (exit 1); the bound file says, beside each bound,
which measurements it came from: about 1.5x the figure on the code that set it, loose
enough that a noisy machine does not fail a good commit, tight enough that a fourfold
regression (the leases' publish, issue 38) fails. Prints one JSON object.

Run: python -m bench.guard [--bounds FILE] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BOUNDS = os.path.join(ROOT, "bench", "guard_bounds.json")


def _run_json(args: list[str], timeout: float) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", *args],
        capture_output=True, text=True, cwd=ROOT, timeout=timeout,
    )  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(runs: int) -> dict[str, list[float]]:
    """Every run's value of every figure."""
    got: dict[str, list[float]] = {"publish_vs_baseline": [], "manifest_vs_baseline": []}
    for _ in range(runs):
        r = _run_json(["bench.commit", "--ranks", "4096", "--engine", "sqlite"], 180)["sqlite"]
        if r["state"] != "published":
            raise RuntimeError(f"bench.commit: the step ended {r['state']}")
        got["publish_vs_baseline"].append(r["publish_vs_baseline"])
        got["manifest_vs_baseline"].append(r["manifest_vs_baseline"])
    d = _run_json(
        ["bench.dcp", "--ranks", "4", "--size", "64MiB", "--rounds", str(runs), "--no-mount"],
        300,
    )
    if not d["loads_exact"]:
        raise RuntimeError("bench.dcp: a load did not give back what was saved")
    got["step2_speedup"] = list(d["rounds_detail"]["step2_speedup"])
    return got


def judge(got: dict[str, list[float]], bounds: dict) -> tuple[dict, list[str]]:
    """(the report, one line per figure past its bound)."""
    report: dict = {}
    failed: list[str] = []
    for name, spec in bounds["figures"].items():
        med = round(statistics.median(got[name]), 3)
        if "max" in spec:
            ok, bound, rel = med <= spec["max"], spec["max"], "<="
        else:
            ok, bound, rel = med >= spec["min"], spec["min"], ">="
        report[name] = {"median": med, "runs": got[name], "bound": f"{rel} {bound}", "ok": ok}
        if not ok:
            failed.append(f"{name}: median {med} is not {rel} {bound} (runs {got[name]})")
    return report, failed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bounds", default=BOUNDS, help="the bound file (JSON)")
    ap.add_argument("--runs", type=int, default=3, help="runs per figure; the median counts")
    args = ap.parse_args(argv)
    if not 1 <= args.runs <= 9:
        ap.error("--runs must be 1..9")
    with open(args.bounds) as f:
        bounds = json.load(f)
    t0 = time.monotonic()
    report, failed = judge(measure(args.runs), bounds)
    doc = {"bench": "guard", "seconds": round(time.monotonic() - t0, 1), "figures": report,
           "verdict": "FAIL" if failed else "PASS"}  # fmt: skip
    print(json.dumps(doc))
    for line in failed:
        print(f"bench.guard: FAIL: {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
