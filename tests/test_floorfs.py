"""bench/floorfs.py, the floors bench.fuse compares the mount with: the storing one must
keep every byte it is given (else its speed would be a false floor), the dropping one
must keep sizes."""

from __future__ import annotations

import errno
import json
import os
import statistics
import subprocess
import sys
import time

import pyfuse3
import pytest
import trio

from bench.fuse import ROOT, unmount, wait_mounted

MiB = 2**20


def _mount(mp: str, *opts: str) -> subprocess.Popen:
    os.makedirs(mp)
    proc = subprocess.Popen([sys.executable, "-m", "bench.floorfs", mp, *opts], cwd=ROOT)
    wait_mounted(mp, proc)
    return proc


def test_the_storing_floor_keeps_every_byte(tmp_path):
    store, mp = str(tmp_path / "store"), str(tmp_path / "mnt")
    os.makedirs(store)
    proc = _mount(mp, "--store", store)
    data = os.urandom(5 * MiB + 123)
    try:
        fd = os.open(os.path.join(mp, "f"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:  # write-only: direct_io, the requests of the writer's own sizes
            for off in range(0, len(data), MiB):
                assert os.write(fd, data[off : off + MiB]) == len(data[off : off + MiB])
            os.fsync(fd)
        finally:
            os.close(fd)
        assert os.stat(os.path.join(mp, "f")).st_size == len(data)
        with open(os.path.join(mp, "f"), "rb") as f:
            assert f.read() == data
        (backing,) = os.listdir(store)
        with open(os.path.join(store, backing), "rb") as f:
            assert f.read() == data
    finally:
        unmount(mp, proc)
    assert proc.returncode == 0


def test_the_dropping_floor_keeps_sizes_only(tmp_path):
    mp = str(tmp_path / "mnt")
    proc = _mount(mp)
    try:
        with open(os.path.join(mp, "f"), "wb") as f:
            f.write(b"x" * (3 * MiB))
            f.flush()
            os.fsync(f.fileno())
        assert os.stat(os.path.join(mp, "f")).st_size == 3 * MiB
        with open(os.path.join(mp, "f"), "rb") as f:
            assert f.read() == bytes(3 * MiB)
        assert not os.path.exists(os.path.join(mp, "g"))
    finally:
        unmount(mp, proc)
    assert proc.returncode == 0


def _slow_writes(monkeypatch, delay: float, fail: OSError | None = None) -> list[int]:
    """Make the writer thread's pwrite slow (so the queue fills) or fail; returns the
    offsets it was asked to write."""
    real = os.pwrite
    seen: list[int] = []

    def pwrite(fd, data, off):
        seen.append(off)
        time.sleep(delay)
        if fail is not None:
            raise fail
        return real(fd, data, off)

    monkeypatch.setattr(os, "pwrite", pwrite)
    return seen


def _storing_floor(tmp_path):
    """A storing FloorFS driven in-process (no mount), and its backing directory."""
    from bench.floorfs import FloorFS

    store = str(tmp_path / "store")
    os.makedirs(store)
    return FloorFS(store), store


def test_the_storing_floor_waits_for_its_queue(tmp_path, monkeypatch):
    """With the writer behind (a full queue): a read returns what was written before it,
    fsync returns once every byte is in the backing file, and a truncating open waits for
    the queued writes instead of having them land past the new end."""
    from bench.floorfs import QUEUE_DEPTH

    fs, store = _storing_floor(tmp_path)
    seen = _slow_writes(monkeypatch, 0.002)
    piece = 64 * 1024
    data = os.urandom(piece * (QUEUE_DEPTH + 8))

    async def run() -> None:
        fi, _ = await fs.create(pyfuse3.ROOT_INODE, b"f", 0o644, os.O_WRONLY | os.O_CREAT, None)
        for off in range(0, len(data), piece):
            assert await fs.write(fi.fh, off, data[off : off + piece]) == piece
        assert await fs.read(fi.fh, 0, len(data)) == data  # waited for the queue
        for off in range(0, len(data), piece):
            await fs.write(fi.fh, off, data[off : off + piece][::-1])
        await fs.open(fi.fh, os.O_WRONLY | os.O_TRUNC, None)
        assert await fs.read(fi.fh, 0, len(data)) == b""
        await fs.write(fi.fh, 0, b"tail")
        await fs.fsync(fi.fh, False)

    trio.run(run)
    assert len(seen) == 2 * len(data) // piece + 1
    (backing,) = os.listdir(store)
    with open(os.path.join(store, backing), "rb") as f:
        assert f.read() == b"tail"


def test_the_storing_floor_reports_a_failed_write_at_fsync(tmp_path, monkeypatch):
    fs, _ = _storing_floor(tmp_path)
    _slow_writes(monkeypatch, 0, OSError(errno.ENOSPC, "full"))

    async def run() -> None:
        fi, _ = await fs.create(pyfuse3.ROOT_INODE, b"f", 0o644, os.O_WRONLY | os.O_CREAT, None)
        await fs.write(fi.fh, 0, b"x" * 4096)
        with pytest.raises(pyfuse3.FUSEError) as err:
            await fs.fsync(fi.fh, False)
        assert err.value.errno == errno.ENOSPC
        await fs.fsync(fi.fh, False)  # reported once

    trio.run(run)


def test_the_parallel_read_floor_reads_every_byte_and_reports_medians(tmp_path):
    """bench.floorread end to end on small files: every round read all readers' bytes on
    both sides (it raises otherwise), and the ratio is the median of the rounds'."""

    proc = subprocess.run(
        [sys.executable, "-m", "bench.floorread", "--readers", "3", "--size-mib", "4",
         "--rounds", "3", "--dir", str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(out["disk_mbps"]) == len(out["floor_mbps"]) == 3
    assert all(x > 0 for x in out["disk_mbps"] + out["floor_mbps"])
    ratios = [f / d for f, d in zip(out["floor_mbps"], out["disk_mbps"], strict=True)]
    assert out["floor_vs_disk"] == round(statistics.median(ratios), 3)
    assert os.listdir(tmp_path) == []
