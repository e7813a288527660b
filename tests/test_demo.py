"""`ckptfs demo` for real: 4 gloo ranks, DCP saves, a FUSE mount, reload, table, clean up."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse on this machine")
def test_demo_runs_and_cleans_up(tmp_path):
    env = dict(os.environ)
    env["XDG_DATA_HOME"] = str(tmp_path / "data")  # the embedded default volume goes here
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    env["TMPDIR"] = str(tmp_path / "tmp")
    os.makedirs(env["TMPDIR"])
    res = subprocess.run(
        [sys.executable, "-m", "fusefs.cli", "demo", "--steps", "2"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    assert "== trained model" in out and "== saved state" in out
    rows = {
        m.group(1): m.group(0) for m in re.finditer(r"^(DCP step \d|torch\.save).*$", out, re.M)
    }
    assert set(rows) == {"DCP step 1", "DCP step 2", "torch.save"}
    dedup2 = float(rows["DCP step 2"].split()[-2])
    assert dedup2 > 5  # the frozen backbone and embedding are not stored again
    # STORED is measured after the tier compressed and uploaded the new chunks (it showed
    # the raw staged bytes, equal to NEW, which read as "compression is off")
    new1, stored1 = _sizes(rows["DCP step 1"])[1:3]
    assert 0 < stored1 < 0.95 * new1, rows["DCP step 1"]
    assert "STORED: what they take on the nodes" in out
    assert re.search(r"timeline of demo-\S+ step 2: published, 4/4 ranks", out)
    # cleaned up: no mount left, no temporary directory, the demo's files removed
    with open("/proc/self/mountinfo") as f:
        assert "ckptfs-demo-" not in f.read()
    assert not [n for n in os.listdir(env["TMPDIR"]) if n.startswith("ckptfs-demo-")]
    vol = os.path.join(env["XDG_DATA_HOME"], "ckptfs", "default")
    ls = subprocess.run(
        [sys.executable, "-m", "fusefs.cli", "ls", vol],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ls.returncode == 0 and "demo-" not in ls.stdout
    # the embedded default volume keeps its nodes beside it, not inside it
    assert os.path.isdir(vol + ".nodes/n0") and not os.path.exists(os.path.join(vol, "nodes"))


_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def _sizes(row: str) -> list[float]:
    """The sizes of a table row in bytes, in column order (LOGICAL, NEW, STORED)."""
    return [float(n) * _UNITS[u] for n, u in re.findall(r"([\d.]+) (B|KiB|MiB|GiB)\b", row)]
