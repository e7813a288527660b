"""The fsspec filesystem and the other frontends see the same files: what fsspec.open
writes reads back identically through a real FUSE mount of the volume and through
`ckptfs get`, and what the mount writes reads back identically through fsspec."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import fsspec
import pytest

from fusefs.client.registry import close_volumes

MiB = 2**20


def test_fsspec_write_reads_back_through_the_mount_and_get(
    new_volume, mount_factory, mount_env, tmp_path, monkeypatch, entry_point_site
):
    vol = new_volume()
    m = mount_factory(vol)
    # the mount's staging directory: this process stages where the mount reads
    monkeypatch.setenv("XDG_CACHE_HOME", mount_env["XDG_CACHE_HOME"])
    data = os.urandom(9 * MiB + 4321)
    try:
        with fsspec.open("ckptfs:///ckpt/model.bin", "wb", volume=vol) as f:
            for off in range(0, len(data), MiB):
                f.write(data[off : off + MiB])
        with open(m.path("ckpt", "model.bin"), "rb") as f:
            assert f.read() == data
        out = tmp_path / "got.bin"
        m.cli("get", vol, "/ckpt/model.bin", str(out), check=True, timeout=300)
        assert out.read_bytes() == data

        back = os.urandom(5 * MiB + 7)
        with open(m.path("ckpt", "from-mount.bin"), "wb") as f:
            f.write(back)
        fs = fsspec.filesystem("ckptfs", volume=vol)
        assert fs.cat_file("/ckpt/from-mount.bin") == back
        assert fs.info("/ckpt/from-mount.bin")["size"] == len(back)
        assert sorted(os.listdir(m.path("ckpt"))) == ["from-mount.bin", "model.bin"]
    finally:
        close_volumes()


def test_the_fsspec_benchmark_alternates_its_rounds_and_reports_their_medians(tmp_path):
    """bench.fsspec end to end on a small size, the tier on RAM and on the disk: every
    round measured all three (disk, mount, fsspec), a tier's ratios are the medians of its
    rounds', the headline is the worse tier's, the CPU per GiB is there for both
    frontends, and the metrics overhead is the scraped daemon's own count of its
    endpoint's CPU over the write's time, at the normal and the amplified rate. Every
    scratch directory is removed, the one on /dev/shm included."""

    def ram_dirs() -> set[str]:
        return {n for n in os.listdir("/dev/shm") if n.startswith("ckptfs-bench-fsspec-")}

    before = ram_dirs()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root)
    proc = subprocess.run(
        [sys.executable, "-m", "bench.fsspec", "--size", "8", "--pairs", "2",
         "--overhead-size", "8", "--rounds", "2", "--staging-size", "1GiB",
         "--dir", str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=root, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(out["tiers"]) == {"ram", "disk"}
    assert out["tiers"]["ram"]["staging_fs"] == "tmpfs"
    for tier in out["tiers"].values():
        rounds = tier["rounds"]
        assert len(rounds) == 2
        for r in rounds:
            for k in ("disk", "mount", "fsspec"):
                assert r[f"{k}_write_mbps"] > 0 and r[f"{k}_read_mbps"] > 0
            assert r["write_vs_mount"] == round(r["fsspec_write_mbps"] / r["mount_write_mbps"], 3)
        for k in ("write_vs_mount", "read_vs_mount"):
            assert tier[k] == round(statistics.median(r[k] for r in rounds), 3)
        assert tier["fsspec_write_cpu_s_per_gib"] > 0 and tier["mount_read_cpu_s_per_gib"] > 0
    for k in ("write_vs_mount", "read_vs_mount"):
        assert out[k] == min(t[k] for t in out["tiers"].values())
    assert out["overhead_tier"] == "ram"
    for part in (out["overhead"], out["amplified"]):
        assert part["scrapes"] >= 2 and part["scrape_cpu_ms"] > 0
        assert len(part["cpu_share_rounds"]) == 2 and min(part["cpu_share_rounds"]) > 0
        assert part["scraped_written_bytes"] >= 8 * 2**20
    share = max(out["overhead"]["cpu_share_rounds"])
    assert out["metrics_overhead_cpu_share"] == share
    scale = max(1.0, out["amplified"]["loss_over_cpu_share"])
    assert out["metrics_overhead"] == pytest.approx(share * scale, abs=1e-4)
    assert out["amplified"]["interval_s"] < out["overhead"]["interval_s"]
    assert os.listdir(tmp_path) == []  # the scratch directories are removed
    assert ram_dirs() <= before
